"""``shard_model`` over every causal-LM family transformers ships: a correct plan, or a clear refusal.

For each entry of transformers' causal-LM mapping (:func:`~schedlang.models.family_configs.causal_lm_families`)
the sweep builds a tiny model (:func:`~schedlang.models.family_configs.tiny_config`) and decides in two steps:

1. **structural** (:func:`decide`): ``shard_model`` on the model built on the meta device, at a
   tensor-parallel world of two ranks: no weights, no real forward. It either writes a plan (the
   family is *accepted*; the plan's blocks are described) or refuses it with a ``SchedlangError``
   (*refused*, with its message). A family that cannot be built from a small config is *skipped*,
   saying why.
2. **verified** (:func:`verify_family`): for an accepted family, ``shard_model`` inside
   ``schedlang.Verify`` on the model with random weights, at TP=2: outputs and every gradient against
   the unsplit model. The family *passes*, or *fails* naming the first mismatch (a gap the structural
   checks should close).

Expert parallelism gets its own column, decided the same two ways: ``expert_parallel()`` over the two
ranks on the meta model (:func:`decide_expert_parallel`: ``—`` for a family without a mixture-of-experts
block, the refusal, or *applies*), then, where it applies, inside ``Verify`` with random weights
(:func:`verify_expert_parallel`: *passes* or *fails* at ep=2, each rank its own tokens).

:func:`run_sweep` runs either over two local ranks (gloo on CPU); :func:`write_table` writes the
result as a reStructuredText table with the date and the versions. From the command line::

    python -m schedlang.models.family_sweep --write docs/families.rst   # the full sweep (tens of minutes)
    python -m schedlang.models.family_sweep --check docs/families.rst   # the structural pass against the table
    python -m schedlang.models.family_sweep --families llama,bloom      # a few, verified, printed

``--results r.json`` keeps the results, and ``--write docs/families.rst --from-results r.json`` writes the
table from them again without sweeping. ``--expert-parallel-only docs/families.rst`` sweeps the expert-parallel
column alone (a minute) and rewrites the table with the other columns as they were.

The CI test re-runs the structural pass for every family (seconds each) and checks that the table
says the same; the full verification runs on a representative subset in the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from .family_configs import Family, FamilySkipped, causal_lm_families, example_ids, meta_model, tiny_model

__all__ = ["FamilyResult", "decide", "verify_family", "decide_expert_parallel", "verify_expert_parallel",
           "run_sweep", "write_table", "read_table", "main", "WORLD"]

logger = logging.getLogger("schedlang.models.family_sweep")

#: the tensor-parallel world of the sweep
WORLD = 2
#: results, in the order the table lists them
RESULTS = ("passes", "fails", "refused", "skipped")
_REASON_LIMIT = 400
#: the expert-parallel column of a family without a mixture-of-experts block (or one that cannot be built)
NO_EXPERTS = "—"


@dataclasses.dataclass
class FamilyResult:
    """One family's line of the table. ``result``: ``passes`` / ``fails`` (verified) or ``accepted`` (structural
    only), ``refused``, ``skipped``; ``reason``: what was split, why it was refused or skipped, or what failed;
    ``expert_parallel``: the expert-parallel column (see the module docstring)."""

    model_type: str
    class_name: str
    result: str
    reason: str
    seconds: float = 0.0
    expert_parallel: str = NO_EXPERTS

    @property
    def decision(self) -> str:
        """The structural decision this line stands for: accepted, refused or skipped."""
        return "accepted" if self.result in ("passes", "fails", "accepted") else self.result

    @property
    def expert_parallel_decision(self) -> str:
        """The structural part of the expert-parallel column: applies, the refusal, or NO_EXPERTS."""
        verified = self.expert_parallel.split(" ", 1)[0] in ("passes", "fails", "applies", "not")
        return "applies" if verified else self.expert_parallel


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _REASON_LIMIT else text[:_REASON_LIMIT - 3] + "..."


def describe_plan(plan) -> str:
    """What a plan splits, in a line: each block of the first layer, what is kept whole, the vocabulary."""
    first = f"{plan.layers}.0."
    parts = []
    for block in plan.blocks:
        where = block.path.replace(first, "", 1) if block.path.startswith(first) else (block.path or "layer")
        extra = f" + per-head {', '.join(n for n, _ in block.head_params)}" if block.head_params else ""
        parts.append(f"{where} ({block.kind}: {'|'.join(block.columns)} -> {block.row}{extra})")
    for experts in getattr(plan, "experts", []):
        if experts.path.startswith(first):
            where = experts.path[len(first):]
            parts.append(f"{where} (experts kept whole: {experts.whole})" if experts.whole else
                         f"{where} (experts split like MLPs)")
    text = "; ".join(parts) if parts else f"schedule {plan.schedule}"
    kept = [p.replace(first, "", 1) for p in getattr(plan, "kept_whole", [])]
    if kept:
        text += f"; kept whole: {', '.join(kept)}"
    if plan.lm_head:
        text += "; vocabulary-parallel head"
    return text


def decide(family: Family, world: int = WORLD) -> FamilyResult:
    """The structural decision for ``family``: ``shard_model`` on its tiny model on the meta device, under
    the current process group (``world`` ranks; every rank must call it)."""
    import schedlang
    from schedlang.errors import SchedlangError

    from . import shard_model

    start = time.monotonic()

    def result(kind: str, reason: str) -> FamilyResult:
        return FamilyResult(family.model_type, family.class_name, kind, _short(reason), time.monotonic() - start,
                            expert_parallel)

    try:
        model, _ = meta_model(family)
    except FamilySkipped as e:
        expert_parallel = NO_EXPERTS
        return result("skipped", str(e))
    expert_parallel = decide_expert_parallel(family)
    sch = schedlang.create_schedule(model)
    try:
        plan = shard_model(sch)
    except SchedlangError as e:
        return result("refused", f"{type(e).__name__}: {e}")
    except Exception as e:  # shard_model itself broke: a defect the table must show, not hide
        return result("fails", f"shard_model raised {type(e).__name__}: {e}")
    return result("accepted", describe_plan(plan))


def decide_expert_parallel(family: Family) -> str:
    """The structural expert-parallel decision for ``family``: ``expert_parallel()`` over the current process
    group on its tiny model on the meta device: ``applies``, ``refused: <error>``, or :data:`NO_EXPERTS`."""
    import schedlang
    from schedlang.errors import SchedlangError

    try:
        model, _ = meta_model(family)
    except FamilySkipped:
        return NO_EXPERTS
    sch = schedlang.create_schedule(model)
    try:
        sch.expert_parallel()
    except SchedlangError as e:
        if "found no mixture-of-experts block" in str(e):
            return NO_EXPERTS
        return _short(f"refused: {type(e).__name__}: {e}")
    except Exception as e:  # the primitive itself broke: shown, not hidden
        return _short(f"fails: expert_parallel raised {type(e).__name__}: {e}")
    return "applies"


def verify_expert_parallel(family: Family, decided: str, world: int = WORLD) -> str:
    """Where expert parallelism ``decided`` applies, ``expert_parallel()`` inside ``Verify`` on the tiny model
    with random weights over the current process group (every rank must call it): ``passes (ep=N)`` or
    ``fails (ep=N): <first mismatch>``; else ``decided`` as it is."""
    if decided != "applies":
        return decided
    import schedlang
    from schedlang.errors import VerificationError

    from ..verify import ExampleInputError

    model, config = tiny_model(family)
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[example_ids(config)]):
            sch.expert_parallel()
    except ExampleInputError as e:
        cause = e.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).replace("Verify: ", "", 1)
        return _short(f"not verified: the original model fails on the example tokens ({why})")
    except VerificationError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        return _short(f"fails (ep={world}): Verify: {lines[0] if lines else e}")
    except Exception as e:  # a crash is a failure too
        return _short(f"fails (ep={world}): {type(e).__name__}: {e}")
    return f"passes (ep={world})"


def verify_family(family: Family, world: int = WORLD) -> FamilyResult:
    """:func:`decide`, then, for an accepted family, ``shard_model`` inside ``Verify`` on the tiny model with
    random weights; and ``expert_parallel`` inside ``Verify`` where it applies (every rank must call it)."""
    import schedlang
    from schedlang.errors import SchedlangError, VerificationError

    from . import shard_model

    decided = decide(family, world)
    expert_parallel = verify_expert_parallel(family, decided.expert_parallel, world)
    if decided.result != "accepted":
        return dataclasses.replace(decided, expert_parallel=expert_parallel)
    start = time.monotonic()

    def result(kind: str, reason: str) -> FamilyResult:
        return FamilyResult(family.model_type, family.class_name, kind, _short(reason),
                            decided.seconds + time.monotonic() - start, expert_parallel)

    model, config = tiny_model(family)
    ids = example_ids(config)
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[ids]):
            shard_model(sch)
    except VerificationError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        return result("fails", f"Verify: {lines[0] if lines else e}")
    except SchedlangError as e:  # refused with real weights but not on the meta device: shown as it is
        return result("refused", f"{type(e).__name__}: {e}")
    except Exception as e:  # a crash is a failure too
        return result("fails", f"{type(e).__name__}: {e}")
    return result("passes", decided.reason)


def _expert_parallel_alone(family: Family, world: int = WORLD) -> FamilyResult:
    """The expert-parallel column alone (decided, then verified), in a result whose other cells are empty."""
    start = time.monotonic()
    column = verify_expert_parallel(family, decide_expert_parallel(family), world)
    return FamilyResult(family.model_type, family.class_name, "", "", time.monotonic() - start, column)


def _work(rank: int, world: int, names: Sequence[str], verify) -> List[FamilyResult]:
    logging.disable(logging.WARNING)  # the families' own warnings (untied weights, defaults) drown the log
    import warnings

    warnings.filterwarnings("ignore")
    by_type = {f.model_type: f for f in causal_lm_families()}
    step = _expert_parallel_alone if verify == "expert_parallel" else verify_family if verify else decide
    return [step(by_type[name], world) for name in names]


def run_sweep(families: Optional[Iterable[str]] = None, verify=True, chunk: int = 16,
              timeout: float = 1800.0, progress=None) -> List[FamilyResult]:
    """Decide (and with ``verify`` verify) every family, or those named, over :data:`WORLD` local gloo ranks
    (``verify="expert_parallel"``: the expert-parallel column alone, the other cells empty);
    ``progress(done, total, result)`` is called after each family. A group of families whose ranks crash is
    retried one family at a time; a family that still crashes is listed as failing, with the error."""
    from ..distributed.launch import run_distributed

    names = [f.model_type for f in causal_lm_families()] if families is None else list(families)
    known = {f.model_type: f for f in causal_lm_families()}
    unknown = [n for n in names if n not in known]
    if unknown:
        from ..errors import ScheduleValueError

        raise ScheduleValueError(f"family_sweep: unknown model type(s) {', '.join(unknown)}; valid are the keys of "
                                 f"transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, e.g. llama, gpt2, mixtral")
    results: List[FamilyResult] = []

    def launch(group: List[str]) -> List[FamilyResult]:
        return run_distributed(_work, world_size=WORLD, args=(group, verify), timeout=timeout)[0]

    for i in range(0, len(names), chunk):
        group = names[i:i + chunk]
        try:
            found = launch(group)
        except Exception as e:  # one family took the ranks down: find it
            logger.info("families %s: %s; retrying one by one", ", ".join(group), e)
            found = []
            for name in group:
                try:
                    found += launch([name])
                except Exception as single:  # this family takes the ranks down
                    found.append(FamilyResult(name, known[name].class_name, "fails",
                                              _short(f"the ranks crashed: {single}")))
        for r in found:
            results.append(r)
            if progress is not None:
                progress(len(results), len(names), r)
    return results


# --------------------------------------------------------------------------------------------- the table

_HEADER = """.. This file is generated: python -m schedlang.models.family_sweep --write docs/families.rst
.. tests/models/test_family_sweep.py checks that it says what the structural pass decides.

HuggingFace families under ``shard_model``
==========================================

Every causal-LM family transformers ships (its ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), built from its
config class at tiny sizes (hidden 64, 4 heads, 2 layers, vocabulary 128, 4 experts) and split by
``shard_model`` over {world} ranks (gloo), inside ``schedlang.Verify`` (outputs and every gradient
against the unsplit model):

* **passes**: the plan is written and Verify passes; the reason column says what is split;
* **refused**: ``shard_model`` refuses the family before any step stays in the plan, naming the module,
  the reason and what to write by hand;
* **skipped**: the family cannot be checked from a small config (encoder-decoder or multimodal
  models, a size the generic shrinking does not reach, a package that is missing);
* **fails**: the plan is written but Verify finds a difference (a gap to close).

The **expert parallel** column says what ``expert_parallel()`` does with the family over the same {world}
ranks, each rank its own tokens and {experts_each}:

* **passes (ep={world})**: the experts are spread and Verify passes (outputs and every gradient, each
  expert slice's against the original's summed over the ranks);
* **refused**: ``expert_parallel`` refuses the family, naming why (experts kept as a list of separate
  MLPs, weights inside the experts);
* **not verified**: the original model itself fails on the example tokens;
* **fails**: Verify finds a difference;
* **—**: the family has no mixture-of-experts block (or cannot be built).

Swept on {date} with torch {torch}, transformers {transformers}: {counts}{ep_date}.

.. list-table::
   :header-rows: 1
   :widths: 15 19 7 41 18

   * - model type
     - class
     - result
     - reason
     - expert parallel
"""


def _counts(results: Sequence[FamilyResult]) -> str:
    tally = {k: sum(r.result == k for r in results) for k in RESULTS}
    return ", ".join(f"{n} {k}" for k, n in tally.items() if n) + f" of {len(results)}"


def _cell(text: str) -> str:
    """``text`` as reStructuredText that reads as written: every character that could start markup escaped."""
    return re.sub(r"([\\*_`|])", r"\\\1", text) or "-"


def write_table(path, results: Sequence[FamilyResult], date: Optional[str] = None,
                expert_parallel_date: Optional[str] = None) -> str:
    """Write ``results`` as the table at ``path`` (returns the text). ``expert_parallel_date``: when the
    expert-parallel column was swept, if not with the rest (``--expert-parallel-only``)."""
    import torch
    import transformers

    date = date or datetime.date.today().isoformat()
    spread = [r for r in results if r.expert_parallel.startswith("passes")]
    text = _HEADER.format(world=WORLD, date=date, torch=torch.__version__.split("+")[0],
                          transformers=transformers.__version__, counts=_counts(results),
                          experts_each="half of each block's experts on each rank",
                          ep_date=(f"; the expert-parallel column on {expert_parallel_date}"
                                   if expert_parallel_date and expert_parallel_date != date else "")
                          + f"; expert parallelism passes on {len(spread)}")
    for r in sorted(results, key=lambda r: r.model_type):
        text += (f"   * - ``{r.model_type}``\n     - {_cell(r.class_name)}\n     - {r.result}\n"
                 f"     - {_cell(r.reason)}\n     - {_cell(r.expert_parallel)}\n")
    Path(path).write_text(text)
    return text


def read_table(path) -> Dict[str, object]:
    """``{"transformers": version, "torch": version, "date": the sweep's date, "rows": {model_type: FamilyResult}}``
    of a written table."""
    text = Path(path).read_text()
    versions = re.search(r"Swept on (\S+) with torch ([^,]+), transformers ([^:]+):", text)
    rows = {}

    def plain(cell: str) -> str:
        cell = re.sub(r"\\(.)", r"\1", cell)
        return "" if cell == "-" else cell

    for m in re.finditer(r"   \* - ``([^`]+)``\n     - (.*)\n     - (\w+)\n     - (.*)\n(?:     - (.*)\n)?", text):
        rows[m.group(1)] = FamilyResult(m.group(1), plain(m.group(2)), m.group(3), plain(m.group(4)),
                                        expert_parallel=plain(m.group(5)) if m.group(5) else NO_EXPERTS)
    return {"date": versions.group(1) if versions else None, "torch": versions.group(2) if versions else None,
            "transformers": versions.group(3) if versions else None, "rows": rows}


def differences(table: Dict[str, FamilyResult], decided: Sequence[FamilyResult]) -> List[str]:
    """Lines naming each family whose structural decision differs from the table's: another decision, or the
    same with another reason (a refusal's or a skip's message, or the description of what a passing family's
    plan splits; a failing family's reason is Verify's, which the structural pass cannot tell)."""
    out = []
    found = {r.model_type: r for r in decided}
    for name in sorted(set(table) | set(found)):
        row, now = table.get(name), found.get(name)
        if row is None or now is None:
            out.append(f"{name}: {'not in the table' if row is None else 'no longer in transformers'}")
            continue
        same_reason = row.result == "fails" or row.reason == now.reason
        if row.decision != now.decision or not same_reason:
            out.append(f"{name}: the table says {row.result} ({row.reason}); now {now.result} ({now.reason})")
        if row.expert_parallel_decision != now.expert_parallel_decision:
            out.append(f"{name}: the table's expert-parallel column says {row.expert_parallel}; now "
                       f"{now.expert_parallel}")
    return out


# --------------------------------------------------------------------------------------------- command line

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schedlang.models.family_sweep",
                                     description="shard_model over every causal-LM family transformers ships")
    parser.add_argument("--write", metavar="PATH", help="run the full sweep (Verify at TP=2) and write the table")
    parser.add_argument("--check", metavar="PATH", help="run the structural pass and compare it with the table")
    parser.add_argument("--families", metavar="A,B", help="only these model types (comma-separated)")
    parser.add_argument("--structural", action="store_true", help="decide only, without Verify")
    parser.add_argument("--results", metavar="PATH", help="also save the results as JSON (with --write or alone)")
    parser.add_argument("--from-results", metavar="PATH", help="write the table from saved results, without sweeping")
    parser.add_argument("--expert-parallel-only", metavar="PATH",
                        help="sweep the expert-parallel column alone and rewrite that table's column")
    args = parser.parse_args(argv)
    families = args.families.split(",") if args.families else None

    def progress(done, total, r):
        print(f"[{done}/{total}] {r.model_type}: {r.result or 'expert parallel'} ({r.seconds:.1f} s) "
              f"{(r.reason or r.expert_parallel)[:160]}", flush=True)

    if args.check:
        table = read_table(args.check)["rows"]
        decided = run_sweep(families or list(table), verify=False, progress=progress)
        problems = differences({k: v for k, v in table.items() if families is None or k in families}, decided)
        for line in problems:
            print(line)
        print(f"{len(decided)} families decided; {len(problems)} differ from {args.check}")
        return 1 if problems else 0
    if args.expert_parallel_only:
        table = read_table(args.expert_parallel_only)
        import torch
        import transformers

        installed = (torch.__version__.split("+")[0], transformers.__version__)
        if installed != (table["torch"], table["transformers"]):
            from ..errors import ScheduleValueError

            raise ScheduleValueError(f"--expert-parallel-only {args.expert_parallel_only}: the table was swept with "
                                     f"torch {table['torch']}, transformers {table['transformers']}, this is torch "
                                     f"{installed[0]}, transformers {installed[1]}; run the full sweep (--write) "
                                     "or install the table's versions (valid: the same torch and transformers)")
        rows = table["rows"]
        swept = {r.model_type: r.expert_parallel
                 for r in run_sweep(families or list(rows), verify="expert_parallel", progress=progress)}
        results = [dataclasses.replace(row, expert_parallel=swept.get(name, row.expert_parallel))
                   for name, row in rows.items()]
        write_table(args.expert_parallel_only, results, date=table["date"],
                    expert_parallel_date=datetime.date.today().isoformat())
        print(f"wrote the expert-parallel column of {args.expert_parallel_only} ({len(swept)} families swept)")
        return 0
    if args.from_results:
        results = [FamilyResult(**r) for r in json.loads(Path(args.from_results).read_text())]
    else:
        results = run_sweep(families, verify=not args.structural, progress=progress)
    if args.results and not args.from_results:
        Path(args.results).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    if args.write:
        write_table(args.write, results)
        print(f"wrote {args.write}: {_counts(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
