"""Verify on an expert-parallel schedule (gloo): each rank runs its own tokens, outputs and non-expert
gradients compared with the original's on them, each expert slice's gradient with the original's summed
over the group; a wrong routing weight and expert gradients reduced over the group are caught."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _flipped_weights(engine):
    """The bug: each token's routing weights swapped between its choices."""
    route = engine.route_to_experts

    def wrong(hidden, index, weights, *rest, **kw):
        return route(hidden, index, weights.flip(-1), *rest, **kw)

    return "route_to_experts", wrong


def _reduced_expert_gradients(engine):
    """The bug: expert gradients summed over the expert-parallel group, whose ranks hold other experts."""
    import torch.distributed as dist

    make = engine.ExpertParallelExperts.from_experts.__func__

    def summed(grad, group):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    def wrong(cls, experts, group, names):
        new = make(cls, experts, group, names)
        for name in names:
            new._parameters[name].register_hook(lambda g, group=group: summed(g, group))
        return new

    return "from_experts", classmethod(wrong)


def _verify(family: str, mesh: dict, group, bug, batch: int, check_backward: bool = True):
    import schedlang
    from schedlang.distributed import expert_parallel as engine
    from schedlang.distributed.mesh import make_mesh
    from tests.helpers.moe_models import VOCAB, tiny_model

    patch = None
    if bug is not None:
        name, replacement = bug(engine)
        owner = engine if name == "route_to_experts" else engine.ExpertParallelExperts
        patch = (owner, name, owner.__dict__[name])
        setattr(owner, name, replacement)
    try:
        model = tiny_model(family)
        sch = schedlang.create_schedule(model, mesh=make_mesh(**mesh) if mesh else None)
        tokens = torch.randint(3, VOCAB, (batch, 7), generator=torch.Generator().manual_seed(0))
        with schedlang.Verify(sch, example_inputs=[tokens], check_backward=check_backward) as check:
            sch.expert_parallel(group)
    except schedlang.VerificationError as e:
        return {"passed": False, "text": str(e)}
    finally:
        if patch is not None:
            setattr(*patch)
    report = check.report
    return {"passed": report.passed, "notes": report.notes, "compared": report.compared,
            "not_compared": report.not_compared, "warnings": report.warnings}


def _worker(rank, world, cases):
    return {name: _verify(*args) for name, args in cases.items()}


def _assert_verified(result, ep: int, rolled: bool = True):
    assert result["passed"], result
    assert not result["not_compared"] and not result["warnings"], result
    assert any(f"expert_parallel (ep={ep})" in n for n in result["notes"]), result["notes"]
    assert any(("rolled by" in n) == rolled for n in result["notes"] if n.startswith("expert_parallel")), result
    assert any("training mode compared with the original" in n for n in result["notes"]), result["notes"]
    experts = [c for c in result["compared"] if "experts.gate_up_proj" in c and "gradient" in c]
    assert len(experts) >= 2 and any(c.startswith("training mode: ") for c in experts), experts
    assert any("output.logits" == c for c in result["compared"])


def test_verify_expert_parallel_at_two_ranks_and_catches_planted_bugs():
    cases = {"world": ("qwen3_moe", None, None, None, 3),
             "mesh_dim": ("deepseek_v3", {"dp": 2}, "dp", None, 2),
             "same_tokens": ("qwen3_moe", None, None, None, 1),
             "routing_weight": ("qwen3_moe", None, None, _flipped_weights, 3),
             "reduced_grads": ("qwen3_moe", None, None, _reduced_expert_gradients, 3)}
    results = run_distributed(_worker, world_size=2, args=(cases,), timeout=300)
    for rank, r in enumerate(results):
        _assert_verified(r["world"], ep=2)
        _assert_verified(r["mesh_dim"], ep=2)
        _assert_verified(r["same_tokens"], ep=2, rolled=False)
        assert any("every rank ran rank 0's tokens" in n for n in r["same_tokens"]["notes"])
        bad = r["routing_weight"]
        assert not bad["passed"] and "output.logits" in bad["text"], bad
        bad = r["reduced_grads"]
        assert not bad["passed"], bad
        assert "gradient of parameter 'model.layers.0.mlp.experts.gate_up_proj' (experts" in bad["text"], bad["text"]
        assert "output.logits" not in bad["text"]  # forward is right: only the expert gradients are wrong


def test_verify_expert_parallel_over_a_mesh_dimension_at_four_ranks():
    # experts spread over 'dp' (2 ranks); the 'tp' ranks beside them share their tokens
    cases = {"dp_of_four": ("qwen3_moe", {"dp": 2, "tp": 2}, "dp", None, 2)}
    results = run_distributed(_worker, world_size=4, args=(cases,), timeout=300)
    for r in results:
        _assert_verified(r["dp_of_four"], ep=2)
