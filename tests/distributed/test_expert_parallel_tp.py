"""Expert parallelism beside tensor and sequence parallelism, at the schedule level (gloo, 4 ranks as dp 2 x tp 2):
``shard_model(sequence_parallel=True)`` keeps the experts whole and each tp rank routes its own sequence slice,
then ``expert_parallel`` spreads them over the data-parallel ranks of one tp rank. Verify passes (outputs and
every gradient, the expert slices' against the original's summed over the group), catches expert gradients
left unsummed over the tp ranks, and experts already split by tensor parallelism are refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _unsummed_over_tp(engine):
    """The bug: a spread slice forgets that its tp ranks each saw only their own sequence slice."""
    make = engine.ExpertParallelExperts.from_experts.__func__

    def wrong(cls, experts, group, names):
        new = make(cls, experts, group, names)
        new.__dict__["sums_over_tp"] = False
        return new

    return classmethod(wrong)


def _verify(family: str, sequence_parallel: bool, bug=None):
    import schedlang
    from schedlang.distributed import expert_parallel as engine
    from schedlang.distributed.expert_mesh import expert_mesh
    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model
    from tests.helpers.moe_models import VOCAB, tiny_model

    original = engine.ExpertParallelExperts.__dict__["from_experts"]
    if bug is not None:
        engine.ExpertParallelExperts.from_experts = bug(engine)
    try:
        mesh = make_mesh(dp=2, tp=2)
        model = tiny_model(family)
        # the auxiliary load-balancing loss reads router logits that the sequence-parallel layers do not hand up
        model.config.output_router_logits = False
        sch = schedlang.create_schedule(model, mesh=mesh)
        # an irregular batch: 3 rows of 10 tokens (5 per tp rank)
        tokens = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
        with schedlang.Verify(sch, example_inputs=[tokens]) as check:
            shard_model(sch, sequence_parallel=sequence_parallel)
            sch.expert_parallel(expert_mesh(mesh, 2))
    except schedlang.VerificationError as e:
        return {"passed": False, "text": str(e)}
    except schedlang.errors.SchedlangError as e:
        return {"passed": False, "refused": f"{type(e).__name__}: {e}"}
    finally:
        engine.ExpertParallelExperts.from_experts = original
    report = check.report
    spread = [m for m in sch.mod.modules() if isinstance(m, engine.ExpertParallelExperts)]
    return {"passed": report.passed, "notes": report.notes, "compared": report.compared,
            "not_compared": report.not_compared, "warnings": report.warnings,
            "sums_over_tp": [m.sums_over_tp for m in spread], "local": [m.local_experts for m in spread]}


def _worker(rank, world, cases):
    return {name: _verify(*args) for name, args in cases.items()}


def test_expert_parallel_beside_sequence_parallel_verifies_and_catches_unsummed_gradients():
    cases = {"qwen3_moe": ("qwen3_moe", True), "mixtral": ("mixtral", True),
             "unsummed": ("qwen3_moe", True, _unsummed_over_tp), "split": ("qwen3_moe", False)}
    results = run_distributed(_worker, world_size=4, args=(cases,), timeout=600)
    for r in results:
        for family in ("qwen3_moe", "mixtral"):
            ok = r[family]
            assert ok["passed"] and not ok["not_compared"] and not ok["warnings"], ok
            assert ok["sums_over_tp"] and all(ok["sums_over_tp"]), ok
            assert any("expert_parallel (ep=2)" in n for n in ok["notes"]), ok["notes"]
            experts = [c for c in ok["compared"] if "experts.gate_up_proj" in c and "gradient" in c]
            assert experts, ok["compared"]
        bad = r["unsummed"]
        assert not bad["passed"] and "text" in bad, bad
        assert "experts.gate_up_proj" in bad["text"] and "output.logits" not in bad["text"], bad["text"]
        refused = r["split"]
        assert not refused["passed"] and "refused" in refused, refused
        assert ("model.layers.0.mlp.experts: expert_parallel cannot spread experts that tensor parallelism split "
                "already") in refused["refused"], refused
