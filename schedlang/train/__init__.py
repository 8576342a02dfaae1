"""The trainer: ``python -m schedlang.train`` and ``schedlang train``.

Trains a HF causal language model of any family transformers' ``AutoModelForCausalLM`` builds (from a
config.json, or the ``tiny`` / ``1b`` presets of LLaMA and GPT-2, with random weights or ``--init-from``
a checkpoint) on a ``pp x dp x tp`` layout of ranks, entirely through schedules: ``shard_model`` for tensor (and
sequence) parallelism, ``fully_shard`` / ``replicate`` for data parallelism, ``cut_pipeline_stage``
for pipeline stages, ``schedlang.build`` to materialize it all. It runs

* under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment): one process per rank;
* with ``--nproc N``: it spawns N local ranks itself (gloo on the CPU, NCCL on GPUs);
* otherwise as a single process.

Whatever the layout, the run computes the same thing: the model starts from the same weights
(built on the meta device and initialized by ``build`` from ``--seed``, shard by shard, so that
every shard equals the slice of the unsharded initialization), the batch of step ``s`` is a pure
function of ``(seed, s)`` and the data (global batch ``B x (L + 1)`` tokens; inputs ``[:, :-1]``,
labels ``[:, 1:]``; data-parallel rank ``d`` takes rows ``[d B/D, (d + 1) B/D)``), and the loss is
the mean token cross entropy over the global batch. In fp32 every layout reports the losses of one
process, up to rounding. The learning rate, the batch and the random state of a step depend on
the step number only, so a run resumed from a checkpoint continues exactly, under any layout.

Fine-tuning (``--init-from DIR``): the model starts from the weights of a HF safetensors checkpoint
instead (``schedlang.build(..., pretrained=DIR)``: each rank reads only the slices it holds), and
its family and config come from ``DIR/config.json`` unless ``--model`` / ``--config`` say otherwise.

Data (``--data``): ``synthetic`` (learnable token sequences generated from the seed), a ``.npy``
file holding a 1-D array of token ids, a raw ``.bin`` file of token ids, read as ``uint16``
when the vocabulary has fewer than 65536 entries and ``uint32`` otherwise (the nanoGPT format), or
text (``.jsonl`` with a ``text`` field, ``.txt``, or a directory of them) with ``--tokenizer``,
tokenized once into a token cache beside it (:mod:`schedlang.train.text`). Each sequence of a batch
starts at an offset drawn from ``(seed, step)``; ``--eval-data`` adds a held-out loss.

Speed: on a GPU the defaults are bf16, per-layer compile, ``optimize_model`` and the fused AdamW; on
several ranks without ``--dp/--tp/--pp`` the layout is chosen by the cost model (``--layout auto``,
:mod:`schedlang.train.layout`), and ``--dry-run`` prints the plan without building anything.

Example::

    python -m schedlang.train --model llama --config tiny --nproc 4 --dp 2 --tp 2 --device cpu \\
        --steps 20 --global-batch 8 --seq 64 --metrics metrics.jsonl
    torchrun --nproc_per_node=8 -m schedlang.train --config 1b --dp 2 --tp 2 --pp 2 --dtype bf16 \\
        --compile --global-batch 32 --seq 2048 --steps 1000 --checkpoint-dir ckpt --save-every 200
    torchrun --nproc_per_node=2 -m schedlang.train --config qwen3/config.json --data corpus.jsonl \\
        --tokenizer qwen3 --global-batch 8 --seq 2048
"""

# ``schedlang.train.<name>`` keeps working for every name below; each lives in the module it is imported from
from .checkpoints import latest_checkpoint
from .command import main
from .configs import Dims, _model_class, model_config, model_dims, validate_model
from .data import EvalBatches, TokenBatches, lr_at, open_data
from .flags import MODELS, OPTIMIZERS, PP_SCHEDULES, TrainError, build_parser, validate
from .loop import PEAK_FLOPS_PER_GPU, train

__all__ = ["main", "TrainError", "build_parser", "model_config", "TokenBatches", "EvalBatches", "PEAK_FLOPS_PER_GPU"]
