"""Verify accepts what ``shard_model`` makes: logits split over the vocabulary are compared slice by slice.

By default ``shard_model`` keeps the logits split over the vocabulary (each rank holds its slice and the
loss is the vocabulary-parallel one). Verify reads the LM head's record (column-parallel, not gathered),
compares each rank's logits with the matching slice of the original's, and sends back through them the
matching slice of the original's random output gradient, so every gradient is compared as well. The
flow the parallelism guide shows (docs/guide/parallelism.rst) is checked here exactly as written there, at
world 2 on gloo.
"""

import re
import textwrap
from pathlib import Path

import pytest
import torch

import schedlang
from schedlang.verify.split_outputs import SplitHead, SplitOutputs, split_heads
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T

ROOT = Path(__file__).resolve().parent.parent


def _readme_snippet() -> str:
    """The parallelism guide's Verify-around-shard_model snippet, as it is written there (a code block,
    indented by three spaces)."""
    text = (ROOT / "docs" / "guide" / "parallelism.rst").read_text()
    found = re.search(r"\n   (with schedlang\.Verify\(sch, example_inputs=\[ids\]\):\n(?:       .*\n)+)", text)
    assert found, ("docs/guide/parallelism.rst no longer shows `with schedlang.Verify(sch, example_inputs=[ids]): "
                   "shard_model(sch)`")
    return textwrap.dedent("   " + found.group(1))


def _readme_flow(family: str):
    from schedlang.models import shard_model

    torch.manual_seed(0)
    model, _ = T.family_model(family)
    ids = torch.randint(2, T.VOCAB, (2, 11))
    sch = schedlang.create_schedule(model)
    scope = {"schedlang": schedlang, "sch": sch, "ids": ids, "shard_model": shard_model}
    exec(_readme_snippet(), scope)  # the README's own lines
    return {"steps": len(sch.plan), "notes": [], "local_vocab": sch["lm_head"].mod.weight.shape[0]}


def _shifted(logits):
    return logits.roll(1, dims=-1)


def _split_logits_report(rank, world):
    """Verify's report for the default plan, and a planted bug in the LM head's slice that it must catch."""
    from schedlang.models import shard_model

    torch.manual_seed(0)
    model, _ = T.family_model("llama")
    ids = torch.randint(2, T.VOCAB, (2, 9))
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        shard_model(sch)
    out = {"notes": check.report.notes, "compared": len(check.report.compared)}

    # a head whose logits land one column off their slice: Verify must still fail
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[ids]):
            shard_model(sch)
            sch["lm_head"].sync(mode="fwd_post", sync_op_or_fn=_shifted)
    except schedlang.VerificationError as e:
        out["bug"] = str(e)
    out["steps_after_bug"] = len(sch.plan)
    return out


def _world2(rank, world):
    results = {family: _readme_flow(family) for family in ("llama", "gpt2", "opt", "qwen3")}
    results["report"] = _split_logits_report(rank, world)
    return results


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=400)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "qwen3"])
def test_the_readme_flow_passes_as_written_with_split_logits(world2, family):
    for r in world2:
        assert r[family]["steps"] > 0
        assert r[family]["local_vocab"] == T.VOCAB // 2  # the logits really stayed split


def test_verify_says_it_compared_slices_and_catches_a_wrong_slice(world2):
    for rank, r in enumerate(world2):
        report = r["report"]
        start = rank * T.VOCAB // 2
        note = (f"output.logits: split over the vocabulary (lm_head is vocabulary-parallel), compared as this rank's "
                f"slice [{start}:{start + T.VOCAB // 2}] of {T.VOCAB} of the original's; its output gradient likewise")
        assert note in report["notes"], report["notes"]
        assert "output.logits" in report["bug"] and "lm_head" in report["bug"], report["bug"]
        assert report["steps_after_bug"] == 0


def test_split_outputs_match_only_the_heads_split_along_the_last_axis():
    head = SplitHead("lm_head", full=10, start=5, local=5)
    split = SplitOutputs([head], {"output.logits": (2, 3, 10), "output.hidden": (2, 3, 5)})
    assert split.head_for("output.logits", (2, 3, 5)) is head
    assert split.head_for("output.logits", (2, 3, 10)) is None  # gathered: compared whole
    assert split.head_for("output.hidden", (2, 3, 5)) is None  # the original has this shape itself
    assert split.head_for("output.logits", (2, 4, 5)) is None  # another batch or sequence: a real mismatch
    full = torch.arange(60.0).reshape(2, 3, 10)
    torch.testing.assert_close(head.take(full), full[..., 5:])
    assert split.full_shape("output.logits", (2, 3, 5)) == (2, 3, 10)


def test_an_unsharded_model_has_no_split_heads():
    model, _ = T.family_model("llama", layers=1)
    assert split_heads(model) == []
