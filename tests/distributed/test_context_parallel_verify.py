"""Verify on a context-parallel schedule: each rank's outputs compared as its tokens of the original's (with
vocabulary-parallel logits too), gradients summed over cp; a wrong attention mask is caught."""

import pytest
import torch

from schedlang.distributed.launch import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _verify(sizes, tp: bool, break_mask: bool):
    import schedlang
    from schedlang.distributed import context_parallel as engine
    from schedlang.distributed.mesh import make_mesh
    from tests.helpers.hf_models import llama

    if break_mask:  # attention that sees the future: every comparison after the first layer must fail
        engine._mask = lambda q_pos, k_pos, window: torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    sch = schedlang.create_schedule(llama(num_key_value_heads=2, vocab_size=128, num_hidden_layers=1), mesh=make_mesh(**sizes))
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    try:
        with schedlang.Verify(sch, example_inputs=[tokens]) as check:
            if tp:
                from schedlang.models import shard_model

                shard_model(sch)  # logits left split over the vocabulary as well as the sequence
            sch.context_parallel()
    except schedlang.VerificationError as e:
        return {"passed": False, "text": str(e)}
    report = check.report
    return {"passed": report.passed, "notes": report.notes, "compared": len(report.compared)}


def _worker(rank, world, cases):
    return {name: _verify(*args) for name, args in cases.items()}


def test_verify_compares_each_ranks_tokens_and_catches_a_wrong_mask():
    results = run_distributed(_worker, world_size=2, args=({"cp": ({"cp": 2}, False, False),
                                                             "wrong": ({"cp": 2}, False, True)},), timeout=240)
    for r in results:
        ok = r["cp"]
        assert ok["passed"], ok
        assert any("split over the sequence (context_parallel, cp=2)" in n for n in ok["notes"]), ok["notes"]
        assert ok["compared"] > 20
        assert not r["wrong"]["passed"]
        assert "output.logits" in r["wrong"]["text"]


def test_verify_with_tensor_parallel_logits_split_twice():
    results = run_distributed(_worker, world_size=4, args=({"cp_tp": ({"cp": 2, "tp": 2}, True, False)},),
                              timeout=240)
    for r in results:
        ok = r["cp_tp"]
        assert ok["passed"], ok
        assert any("split over the sequence" in n and "vocabulary" in n for n in ok["notes"]), ok["notes"]
