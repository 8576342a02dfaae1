"""Pipeline stages: split a built model after its ``cut_pipeline_stage`` modules and run the stages
with ``torch.distributed.pipelining`` on the ``pp`` ranks.

How an unchanged model is split
-------------------------------
A transformers model's ``forward`` does more than call its layers in a row: it builds the causal
mask, the rotary embeddings and position ids, slices hidden states and wraps the result in a
``ModelOutput``. Cutting it by hand would mean rewriting that forward per model family. Instead
the whole model is traced once, at build, with schedlang's hierarchy-keeping tracer
(:mod:`schedlang.graph.tracer`), keeping every module that is *not* an enclosing module of a cut
as a ``call_module`` leaf: for cuts after ``model.layers.1`` and ``model.layers.3`` of a LLaMA, only
``LlamaForCausalLM.forward`` and ``LlamaModel.forward`` are traced through, and ``embed_tokens``,
``rotary_emb``, every decoder layer, ``norm`` and ``lm_head`` stay calls of the original module
objects. The graph is then partitioned in execution order: stage ``k`` holds everything after the
``k``-th cut node up to and including the ``(k+1)``-th. ``torch.distributed.pipelining.pipeline``
(``torch.export``) was the alternative; it turns the model into exported graph modules, which
do not keep the original module objects with their forward hooks (tensor-parallel local views,
sync ops) and instance-level forwards (activation checkpointing), so the contract below could
not hold.

Why this keeps tensor and data parallelism working: a stage module is an ``fx.GraphModule``
whose submodules are the *original* module objects at their *original* paths (intermediate
containers re-created, ``model.layers`` stays an ``nn.ModuleList`` holding only this stage's
layers). So ``stage.state_dict()`` has exactly the original keys for the tensors the stage holds,
with the very same tensor objects (DTensor parameters included), forward hooks (tensor-parallel
local views, sync ops, activation checkpointing) still run because the leaves are called as
modules, and ``fully_shard`` on ``model.layers.3`` or on the stage root works by path. Only the
traced-through enclosing modules (``model``, ``model.layers``) are never called, so data
parallelism must wrap the layers and the stage root, not those (checked: a fully_shard or
replicate on one of them raises :class:`~schedlang.errors.PipelineError`).

What crosses a stage boundary
-----------------------------
``PipelineStage`` sends tensors, from each stage to the next only. A value computed in stage
``i`` and used in stage ``j > i + 1`` (the rotary ``(cos, sin)`` pair, the mask, position ids)
is relayed by the stages in between. Tuples are sent element by element and rebuilt. Values that
carry no gradient are sent as float tensors and converted back in the receiving stage: integer
tensors (position ids; exact up to 2**53), boolean masks, ``None`` (an empty tensor: the HF
mask builders return ``None`` at run time when SDPA can use ``is_causal``, so the mask is "a
tensor or None" and crosses as such) and Python numbers. An int (GPT-2 sends its output shape)
travels in the *shape* of an empty tensor, because torch's stages infer shapes before the first
step by sending zero-filled tensors, so a size sent as data would read 0 there; a float travels
as data (a float that decides a shape would break that inference). Such values are wired to
the stage output with zero gradients, because torch 2.11's stages expect a gradient for every
received tensor and torch 2.13's for every output that requires one; both then agree. Non-tensor
values that are not graph values (``None`` arguments, Python constants) are already folded into
the consumer's code by the tracer. Anything else (a cache object, a dict) makes the build fail
with an error naming the value and the cut.

The model output
----------------
The last stage returns one tensor: ``.logits`` of a transformers model output (the model is
called with only its main input, ``input_ids``, and ``use_cache=False``), the first element of a
tuple output, or a plain tensor output. ``loss_fn(output, target)`` gets it per microbatch.

Gradient scaling
----------------
torch's schedules are built with ``scale_grads=False`` and :meth:`PipelinedModel.step` divides
every local parameter's gradient by ``n_microbatches`` once after the schedule's backward
(torch's own ``scale_grads`` would divide a parameter that two local stages share twice). With a
``loss_fn`` that returns the mean loss of its microbatch and equal-sized microbatches, the
gradient after ``step`` is the gradient of the mean loss over the full batch, as if the unsplit
model had run on it once. Gradients accumulate in ``.grad`` like ``backward``: zero them between
steps (the division applies to what ``.grad`` holds).

Tied weights
------------
A parameter that two stages use (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is
kept correct: each pp rank holding one of those stages keeps the tensor under its own name in
its stage module (the same object when both stages are on one rank), the copies start equal
(the lowest holder's values are sent to the others at build) and after every step the holders
add their gradients (point-to-point over the pp group, summed in rank order, so every copy gets
the same total and takes the same optimizer step). FSDP on a tied weight held by two stages of
one rank is not supported.

Context parallelism
-------------------
A model ``context_parallel`` split is traced with ``position_ids`` as a graph input beside its main input,
and the first stage gets the split the root's pre-hook would have made: it takes the full ``[b, L]``
microbatch and keeps this rank's tokens with their global positions. ``target`` stays the full labels;
``loss_fn`` keeps this rank's part (``context_parallel_loss`` does).

Limits
------
* The ZeroBubble schedule with ``fully_shard`` is refused: measured on torch 2.13 (gloo) its
  later steps drift from one process, while ZeroBubble alone or with ``replicate``, and the
  other schedules with ``fully_shard``, agree.
* The enclosing modules that are traced through run as code of the stage modules: their own
  forward hooks do not run, and ``fully_shard`` / ``replicate`` on them is refused.
* Every rank builds the whole model before keeping its stages; the other stages' tensors are
  freed only when nothing else (the schedule) refers to the full model.
* For a model that is not a transformers model, pass ``example_inputs`` (in ``options``) so that
  what crosses each cut is known at build; otherwise it is checked when the stages run.

Example::

    sch = schedlang.create_schedule(model, mesh=make_mesh(pp=2))
    sch["model.layers.1"].cut_pipeline_stage()
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=1e-3,
                                 pipeline={"schedule": "1F1B", "n_microbatches": 4, "loss_fn": loss_fn})
    losses = []
    model.step(input_ids, target=labels, losses=losses)   # losses filled on the last stage
    opt.step(); opt.zero_grad()
"""

# transport: what crosses a cut at run time; partition: tracing and the split of the graph; stages: the
# stage modules; tied: weights shared by stages; runtime: options, torch's schedules, PipelinedModel
from .runtime import SCHEDULES, PipelinedModel, build_pipeline
from .stages import split_model

__all__ = ["SCHEDULES", "build_pipeline", "split_model", "PipelinedModel"]
