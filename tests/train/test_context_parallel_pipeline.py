"""Context parallelism with pipeline stages: the root's forward never runs under a pipeline, so the first stage
keeps this rank's tokens with their global positions, the last stage's loss gets this rank's labels, and each
stage's gradients are averaged over the cp ranks of its pp coordinate. Checked against one process: the
trainer's losses and gradient norms at pp 2 x cp 2 (1F1B with FSDP, GPipe with DDP), and ``schedlang.build``
with a pipeline on its own (no data parallelism: the averaging hook), for LLaMA and Mistral (sliding window)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from schedlang.distributed.launch import run_distributed
from tests.helpers.trainer_runs import assert_same_steps, run_metrics

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

COMMON = ["--model", "llama", "--config", "tiny", "--steps", "3", "--global-batch", "4", "--seq", "24",
          "--lr", "3e-3", "--device", "cpu", "--dtype", "fp32", "--seed", "7"]


def _run(tmp: Path, name: str, *flags: str):
    return run_metrics(COMMON + list(flags), tmp / f"{name}.jsonl")


def _assert_same(records, reference):
    assert [r["step"] for r in records] == [1, 2, 3]
    assert_same_steps(records, reference)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("train_cp_pp")


@pytest.fixture(scope="module")
def reference(work):
    return _run(work, "single")


@pytest.mark.parametrize("flags", [
    ("--nproc", "4", "--pp-schedule", "1F1B", "--dp-mode", "fsdp"),
    ("--nproc", "4", "--pp-schedule", "GPipe", "--dp-mode", "ddp"),
    # two stages per rank: each rank's two stages gather over the same cp group, in the schedule's order
    ("--nproc", "4", "--pp-schedule", "Interleaved1F1B"),
    # beside tensor parallelism: every (pp, tp) coordinate has its own cp group
    ("--nproc", "8", "--tp", "2"),
], ids=["1f1b-fsdp", "gpipe-ddp", "interleaved", "tp2"])
def test_pp2_cp2_trains_like_one_process(reference, work, flags):
    records = _run(work, "pp2-cp2-" + "-".join(flags[1::2]), "--pp", "2", "--cp", "2", *flags)
    _assert_same(records, reference)


VOCAB = 128
SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=128)


def _model(family: str):
    import transformers as tf

    config = tf.LlamaConfig(**SIZES) if family == "llama" else tf.MistralConfig(**SIZES, sliding_window=5)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (tf.LlamaForCausalLM if family == "llama" else tf.MistralForCausalLM)(config)
    with torch.no_grad():  # random norms, so a wrong token order cannot hide behind unit scales
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.rand_like(p) * 0.5)
    return model


def _case(family: str, length: int):
    import schedlang
    from schedlang.distributed.mesh import make_mesh

    reference = _model(family)
    mesh = make_mesh(pp=2, cp=2)
    sch = schedlang.create_schedule(copy.deepcopy(reference), mesh=mesh)
    sch.context_parallel()
    sch["model.layers.1"].cut_pipeline_stage()
    microbatches = 2

    def loss_fn(logits, target):  # this rank's logits, the microbatch's full labels
        return schedlang.context_parallel_loss(logits, target, sch.mod)

    model, _ = schedlang.build(sch, optimizer=torch.optim.SGD, lr=0.1,
                               pipeline={"schedule": "1F1B", "n_microbatches": microbatches, "loss_fn": loss_fn})
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4, length))
    losses = []
    model.step(tokens, target=tokens, losses=losses)

    ref_losses = [reference(x, labels=x).loss for x in tokens.chunk(microbatches)]
    torch.stack(ref_losses).mean().backward()
    ref_grads = dict(reference.named_parameters())
    worst, held = 0.0, []
    for stage in model.stage_modules:
        for name, p in stage.named_parameters():
            held.append(name)
            want = ref_grads[name].grad
            worst = max(worst, float((p.grad - want).abs().max() / (want.abs().max() + 1e-6)))
    return {"losses": [float(l) for l in losses], "ref_losses": [float(l) for l in ref_losses], "grad": worst,
            "held": held, "pp_rank": mesh.get_local_rank("pp")}


def _worker(rank, world, cases):
    return {name: _case(*args) for name, args in cases.items()}


def test_build_with_a_pipeline_and_context_parallel_matches_one_process():
    cases = {"llama": ("llama", 16), "mistral": ("mistral", 20)}
    results = run_distributed(_worker, world_size=4, args=(cases,), timeout=300)
    for name in cases:
        held = {}
        for rank_results in results:
            r = rank_results[name]
            assert r["grad"] < 1e-4, (name, r)
            held.setdefault(r["pp_rank"], set()).update(r["held"])
            if r["pp_rank"] == 1:  # the last stage: one loss per microbatch, each the global mean of its rows
                torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                                           rtol=1e-5, atol=1e-5)
            else:
                assert r["losses"] == []
        everything = {n for n, _ in _model(name).named_parameters()}
        assert held[0] | held[1] == everything and not held[0] & held[1], name


def test_attention_on_fake_tensors_gives_the_gathered_shape_without_a_collective():
    # the pipeline's split of the model at build runs every module on fake tensors: the K/V all-gather has no
    # peers there (and no process group at all here), so it must give the shape alone
    from torch._subclasses.fake_tensor import FakeTensorMode

    from schedlang.distributed.context_parallel import ContextParallelGroup, context_parallel_attention

    attention = torch.nn.Module()
    attention._schedlang_context_parallel = ContextParallelGroup(group=None, size=2, rank=1)
    with FakeTensorMode():
        query = torch.randn(3, 4, 6, 8)
        key, value = torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
        out, _ = context_parallel_attention(attention, query, key, value, None, sliding_window=5)
    assert tuple(out.shape) == (3, 6, 4, 8)
