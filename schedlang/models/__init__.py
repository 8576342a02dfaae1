"""Tensor parallelism for HF models (transformers 5.x): an automatic plan, and family overrides of it.

:func:`shard_model` writes the ``shard`` and ``sync`` steps of Megatron-style tensor parallelism
(attention heads, MLP, vocabulary-parallel embeddings and LM head; optionally sequence
parallelism) into a schedule, so they are recorded in its plan, checked by ``Verify`` and
materialized per rank by ``build``::

    from schedlang.models import shard_model
    sch = schedlang.create_schedule(model)
    print(shard_model(sch, sequence_parallel=True))
    model, opt = schedlang.build(sch, optimizer="adamw")

The plan is found from the model's structure and code (:mod:`schedlang.models.auto`). A few
families have a thin override of it, one file each: ``shard_llama`` (LLaMA's options: where the
gradients are summed, unsplit embeddings), ``shard_gpt2`` (checks GPT-2's layout, refuses
cross-attention) and ``shard_bert`` (names BERT's blocks, which span several modules, and keeps
the MLM loss as it is). :func:`register_family` adds a family's own schedule.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Dict, List, Sequence

from ..errors import ArgumentTypeError, ScheduleTypeError, ScheduleValueError

from .auto import TensorParallelPlan, shard_auto
from .auto import plan_tensor_parallel as _automatic_plan
from .bert import shard_bert
from .compiling import LAYER_LISTS, _check_compile_options, _with_passes, compile_layers  # noqa: F401
from .gpt2 import shard_gpt2
from .llama import shard_llama
from .optimize import optimize_model

__all__ = ["shard_llama", "shard_gpt2", "shard_bert", "shard_auto", "shard_model", "plan_tensor_parallel",
           "register_family", "compile_layers", "optimize_model", "FAMILIES", "TensorParallelPlan"]

#: class-name prefix -> schedule function (an override of the automatic plan); :func:`register_family` adds to it
FAMILIES = {"Llama": shard_llama, "GPT2": shard_gpt2, "Bert": shard_bert}


def register_family(prefix: str, fn: Callable) -> Callable:
    """Make :func:`shard_model` use ``fn(sch, **options)`` for models whose class name starts with ``prefix``
    (the longest registered prefix wins); returns ``fn``, so it works as a decorator factory's result too.

    Example::

        def shard_opt(sch, gather_logits=False):
            ...
        register_family("OPT", shard_opt)
    """
    if not isinstance(prefix, str) or not prefix:
        raise ScheduleValueError(f"register_family: the prefix must be a non-empty class-name prefix, got {prefix!r}")
    if not callable(fn):
        raise ScheduleTypeError(f"register_family: {fn!r} for {prefix!r} is not callable; pass fn(sch, **options)")
    FAMILIES[prefix] = fn
    return fn


def shard_model(sch, **options) -> TensorParallelPlan:
    """Write tensor parallelism for ``sch``'s model into it; returns the plan it chose (``print`` it).

    A family registered in :data:`FAMILIES` (LLaMA, GPT-2, BERT, and what :func:`register_family`
    adds) uses its own schedule; any other model gets the automatic plan
    (:func:`~schedlang.models.auto.shard_auto`), found from the model's structure and code.
    ``sequence_parallel=True`` also splits the activations between the blocks along the sequence
    (the returned plan says so); ``gather_logits=True`` all-gathers the logits.

    ``float8="tensorwise"`` (or ``"rowwise"``, or a dict of :meth:`Schedule.float8` arguments) then
    converts the decoder layers' Linears to float8 training, checked on their tensor-parallel shards.

    Example::

        print(shard_model(schedlang.create_schedule(OPTForCausalLM(config)), gather_logits=True))
    """
    float8 = options.pop("float8", None)
    float8_args = _float8_arguments(float8)
    name = type(sch.mod).__name__
    matches = [p for p in FAMILIES if name.startswith(p)]
    fn = FAMILIES[max(matches, key=len)] if matches else shard_auto
    # every option is checked against the schedule that will take it before any step is written
    _check_options("shard_model", fn, options, also=("float8",),
                   taker=f" for {name} (schedule {getattr(fn, '__name__', repr(fn))})")
    with sch.root.atomic():
        if not matches:
            plan = shard_auto(sch, **options)
        else:
            before = len(sch.root.plan)
            plan = fn(sch, **options)
            if not isinstance(plan, TensorParallelPlan):  # a schedule of its own: describe what it did
                plan = TensorParallelPlan(model=name, schedule=getattr(fn, "__name__", repr(fn)),
                                          logits="gathered" if options.get("gather_logits") else "split",
                                          sequence_parallel=bool(options.get("sequence_parallel")),
                                          steps=len(sch.root.plan) - before)
        if float8_args is not None:
            from .optimize import _layer_paths

            for path in _layer_paths(sch.root):
                sch.root[path].float8(**float8_args)
    return plan


def _float8_arguments(float8):
    if float8 is None:
        return None
    if isinstance(float8, str):
        return {"recipe": float8}
    if isinstance(float8, dict):
        from ..schedule import Schedule

        # an unknown key would otherwise surface as a bare TypeError from the first layer's float8 call
        valid = _option_names(Schedule.float8)
        unknown = [k for k in float8 if k not in valid]
        if unknown:
            raise ArgumentTypeError(f"shard_model: float8 has unknown Schedule.float8 argument"
                                    f"{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; valid "
                                    f"keys are {', '.join(valid)}")
        return dict(float8)
    raise ScheduleTypeError(f"shard_model: float8 must be None, a recipe name ('tensorwise', 'rowwise') or a dict of "
                            f"Schedule.float8 arguments, got {type(float8).__name__}")


#: options every tensor-parallel schedule takes as flags; ``bool("no")`` is True, so a string must not pass for one
_FLAG_OPTIONS = ("sequence_parallel", "gather_logits")


def _option_names(fn: Callable) -> List[str]:
    """The names ``fn(sch, ...)`` takes after the schedule (``self`` for a method)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _check_options(where: str, fn: Callable, options: Dict, also: Sequence[str] = (), taker: str = "") -> None:
    """Refuse options ``fn(sch, **options)`` does not take (a bare TypeError otherwise, maybe after other steps),
    and a flag that is not a bool. ``also``: options the caller takes itself, named among the valid ones;
    ``taker``: which model and schedule the valid options are those of."""
    params = {p.name: p for p in list(inspect.signature(fn).parameters.values())[1:]}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())  # a family schedule of its own
    names = _option_names(fn)
    unknown = [k for k in options if k not in names]
    if unknown and not takes_any:
        raise ArgumentTypeError(f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(map(repr, unknown))}; valid options{taker} are "
                                f"{', '.join(names + list(also))}")
    for key, value in options.items():
        declared = params.get(key)
        is_flag = key in _FLAG_OPTIONS or (declared is not None and isinstance(declared.default, bool))
        if is_flag and not isinstance(value, bool):
            raise ScheduleValueError(f"{where}: {key} must be True or False, got {type(value).__name__} {value!r}")


@functools.wraps(_automatic_plan)
def plan_tensor_parallel(sch, *args, **options) -> TensorParallelPlan:
    # the automatic plan itself (models.auto) takes its options by name; checked here so that a misspelt
    # option or sequence_parallel="yes" is a ScheduleValueError, not a TypeError or a silently wrong plan
    _check_options("plan_tensor_parallel", _automatic_plan,
                   {**dict(zip(_option_names(_automatic_plan), args)), **options})
    return _automatic_plan(sch, *args, **options)
