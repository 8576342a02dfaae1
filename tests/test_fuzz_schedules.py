"""Random schedules (shard, sync, checkpoint, fork_rng, replace, decompose, fuse) over random MLP and small
transformer shapes, at world size 1 and 2.

Every schedule must either pass Verify or raise a SchedlangError: never another exception, never a hang.
When Verify passes, the scheduled model must compute what plain PyTorch computes (outputs and the
gradients of every parameter left whole), and the user's model must be unchanged.

Schedules are plain tuples, drawn by Hypothesis (derandomized, so CI sees the same ones every run).
At world size 2 they are drawn first and then all run in one pair of spawned ranks (spawning is slow).
"""

import copy

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import schedlang
from schedlang.models.tiny_transformer import TinyConfig, TinyTransformer
from tests.helpers.distributed import run_distributed
from tests.helpers.models import MLP, assert_unchanged, state_snapshot


# ---------------------------------------------------------------------------------------------- models
def _build(model_spec):
    kind = model_spec[0]
    torch.manual_seed(model_spec[-1])  # the same weights on every rank
    if kind == "mlp":
        _, hidden, inner, seed = model_spec
        return MLP(hidden, inner), torch.randn(3, 5, hidden)
    _, hidden, heads, inner, dropout, seed = model_spec
    cfg = TinyConfig(vocab_size=40, hidden_size=hidden, num_heads=heads, intermediate_size=inner, num_layers=1,
                     max_positions=16, dropout=dropout)
    return TinyTransformer(cfg), torch.randint(0, 40, (2, 6))


def _paths(model_spec):
    if model_spec[0] == "mlp":
        return {"mlp": [""], "attn": [], "linear": ["fc1", "fc2"], "act": ["act"], "checkpoint": ["fc1", "act", "fc2"],
                "fork": ["act"]}
    return {"mlp": ["blocks.0.mlp"], "attn": ["blocks.0.attn"],
            "linear": ["blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "blocks.0.attn.q_proj", "blocks.0.attn.out_proj",
                       "head"],
            "act": ["blocks.0.mlp.act"], "checkpoint": ["blocks.0", "blocks.0.mlp", "blocks.0.attn"],
            "fork": ["blocks.0.drop", "blocks.0.mlp"]}


# ---------------------------------------------------------------------------------------------- steps
def _at(sch, path):
    return sch[path] if path else sch


def _megatron_mlp(sch, path):
    m = _at(sch, path)
    m["fc1"].shard("weight", axis=0)
    m["fc1"].shard("bias", axis=0)
    m["fc2"].shard("weight", axis=1)
    m["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    m["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def _megatron_attn(sch, path):
    a = _at(sch, path)
    for name in ("q_proj", "k_proj", "v_proj"):
        a[name].shard("weight", axis=0)
        a[name].shard("bias", axis=0)
    a["out_proj"].shard("weight", axis=1)
    a["out_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    a.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def _bias_gelu(x, bias):
    return F.gelu(x + bias)


def _fuse_bias_gelu(sch, path):
    m = _at(sch, path)
    m["fc1"].decompose()
    m.trace(flatten=True)
    m.fuse(m.find(_bias_gelu), compiler="eager", name="BiasGeLU")


_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh_gelu": lambda: nn.GELU(approximate="tanh")}


def _apply(sch, op):
    name, path, *rest = op
    if name == "megatron_mlp":
        _megatron_mlp(sch, path)
    elif name == "megatron_attn":
        _megatron_attn(sch, path)
    elif name == "shard":
        _at(sch, path).shard(rest[0], axis=rest[1])
    elif name == "sync":
        _at(sch, path).sync(mode=rest[0], sync_op_or_fn="all_reduce")
    elif name == "checkpoint":
        _at(sch, path).checkpoint(preserve_rng_state=rest[0])
    elif name == "fork_rng":
        _at(sch, path).fork_rng()
    elif name == "replace_act":
        _at(sch, path).replace(_ACTIVATIONS[rest[0]]())
    elif name == "replace_copy":
        _at(sch, path).replace(copy.deepcopy(_at(sch, path).mod))
    elif name == "decompose":
        _at(sch, path).decompose()
    elif name == "fuse_bias_gelu":
        _fuse_bias_gelu(sch, path)
    else:  # pragma: no cover
        raise AssertionError(f"unknown fuzz step {op}")


# ---------------------------------------------------------------------------------------------- strategies
@st.composite
def schedules(draw, world):
    if draw(st.booleans()):
        hidden, inner = draw(st.sampled_from([(8, 12), (6, 10), (7, 13), (10, 14)]))
        model_spec = ("mlp", hidden, inner, draw(st.integers(0, 3)))
    else:
        hidden, heads = draw(st.sampled_from([(16, 4), (12, 2), (8, 2)]))
        model_spec = ("tiny", hidden, heads, draw(st.sampled_from([24, 20, 15])), draw(st.sampled_from([0.0, 0.2])),
                      draw(st.integers(0, 3)))
    p = _paths(model_spec)
    options = [st.tuples(st.just("shard"), st.sampled_from(p["linear"]), st.sampled_from(["weight", "bias"]),
                         st.integers(0, 1)),
               st.tuples(st.just("sync"), st.sampled_from(p["linear"]),
                         st.sampled_from(["fwd_post", "bwd_post", "fwd_pre"])),
               st.tuples(st.just("checkpoint"), st.sampled_from(p["checkpoint"]), st.booleans()),
               st.tuples(st.just("fork_rng"), st.sampled_from(p["fork"])),
               st.tuples(st.just("replace_act"), st.sampled_from(p["act"]), st.sampled_from(sorted(_ACTIVATIONS))),
               st.tuples(st.just("replace_copy"), st.sampled_from(p["linear"])),
               st.tuples(st.just("decompose"), st.sampled_from(p["linear"])),
               st.tuples(st.just("fuse_bias_gelu"), st.sampled_from(p["mlp"])),
               st.tuples(st.just("megatron_mlp"), st.sampled_from(p["mlp"]))]
    if p["attn"]:
        options.append(st.tuples(st.just("megatron_attn"), st.sampled_from(p["attn"])))
    if world > 1:  # lean towards tensor-parallel schedules, the ones that need two ranks
        options = options[:4] + [options[-1]] * 3 + ([options[-2]] * 3 if p["attn"] else [])
    ops = draw(st.lists(st.one_of(*options), min_size=1, max_size=4))
    return model_spec, ops


# ---------------------------------------------------------------------------------------------- the property
def _same_as_plain_pytorch(model, scheduled, x):
    model, scheduled = copy.deepcopy(model).eval(), scheduled.eval()
    g = torch.Generator().manual_seed(5)
    xr = x.clone().requires_grad_(True) if x.is_floating_point() else x
    xs = x.clone().requires_grad_(True) if x.is_floating_point() else x
    ref, out = model(xr), scheduled(xs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    cot = torch.randn(ref.shape, generator=g)
    (ref * cot).sum().backward()
    (out * cot).sum().backward()
    if x.is_floating_point():
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-5)
    ref_params = dict(model.named_parameters())
    compared = 0
    for name, p in scheduled.named_parameters():
        ref = ref_params.get(name)
        if ref is not None and ref.shape == p.shape and p.grad is not None and not hasattr(p, "_schedlang_shard"):
            torch.testing.assert_close(p.grad, ref.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
            compared += 1
    return compared


def run_schedule(spec):
    """``("passed", n)``, ``("rejected", error class)``; anything else raises (a crash: the test fails)."""
    model_spec, ops = spec
    model, x = _build(model_spec)
    before = state_snapshot(model)
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[x]):
            for op in ops:
                _apply(sch, op)
    except schedlang.SchedlangError as e:
        assert len(sch.plan) == 0, f"{spec}: a failed Verify block left steps in the plan"
        assert_unchanged(model, before)
        return "rejected", type(e).__name__
    assert_unchanged(model, before)
    return "passed", _same_as_plain_pytorch(model, sch.mod, x)


_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=25, **_SETTINGS)
@given(schedules(world=1))
def test_random_schedules_at_world_1_pass_verify_or_raise_a_schedlang_error(spec):
    outcome, detail = run_schedule(spec)
    assert outcome in ("passed", "rejected"), (spec, outcome, detail)


def _world2_specs(n=6):
    specs = []

    @settings(max_examples=n, phases=[Phase.generate], **_SETTINGS)
    @given(schedules(world=2))
    def collect(spec):
        specs.append(spec)

    collect()
    return specs


def _run_all(rank, world, specs):
    out = []
    for spec in specs:
        try:
            out.append(run_schedule(spec))
        except Exception as e:  # name the schedule that crashed
            raise AssertionError(f"schedule {spec} crashed on rank {rank}: {type(e).__name__}: {e}") from e
    return out


# correct tensor-parallel schedules, so that the "passes and equals PyTorch" side runs at world size 2 too
_WORLD2_CORRECT = [
    (("mlp", 10, 14, 0), [("megatron_mlp", ""), ("fork_rng", "act"), ("checkpoint", "fc2", True)]),
    (("tiny", 16, 4, 24, 0.2, 0), [("megatron_attn", "blocks.0.attn"), ("megatron_mlp", "blocks.0.mlp"),
                                   ("checkpoint", "blocks.0", True)]),
]


def test_random_schedules_at_world_2_pass_verify_or_raise_a_schedlang_error():
    specs = _WORLD2_CORRECT + _world2_specs()
    assert len(specs) >= 6
    results = run_distributed(_run_all, world_size=2, args=(specs,), timeout=300)
    assert results[0] == results[1]  # the ranks agree on every outcome
    assert all(outcome in ("passed", "rejected") for outcome, _ in results[0])
    assert results[0][0] == ("passed", 1) and results[0][1][0] == "passed"  # fc2.bias; the layers


def test_the_fuzzer_reaches_both_outcomes():
    # a correct Megatron MLP passes, a wrong activation is rejected: the property is not vacuous
    assert run_schedule((("mlp", 8, 12, 0), [("megatron_mlp", "")]))[0] == "passed"
    assert run_schedule((("mlp", 8, 12, 0), [("replace_act", "act", "relu")])) == ("rejected", "VerificationError")
    assert run_schedule((("tiny", 16, 4, 24, 0.2, 0), [("checkpoint", "blocks.0", False)])) == \
        ("rejected", "VerificationError")
