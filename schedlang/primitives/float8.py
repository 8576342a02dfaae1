"""``float8(recipe="tensorwise", ...)``: train the Linears under a module in float8, through torchao.

Each selected ``nn.Linear`` becomes a ``torchao.float8.Float8Linear``: its matmuls (forward, and both
backward products) cast their operands to float8 with dynamic scales (``tensorwise``: one scale per
tensor; ``rowwise``: one per row) and run on the float8 tensor cores (H100 / H200 and newer). The
weights stay in their own dtype, so optimizers, FSDP2, checkpoints and exports see ordinary
parameters. schedlang writes no float8 arithmetic of its own.

Which Linears are converted (the others are skipped, each with its reason, logged and returned):

* both dimensions divisible by 16 (what the float8 GEMMs need), checked on the *current* shapes, so
  a tensor-parallel shard is checked as each rank will run it: call ``float8`` after ``shard``;
* not the LM head (a Linear named ``lm_head`` / ``output`` or one whose weight is tied to an
  embedding): the logits feed the loss directly, where float8 rounding costs the most;
* not tiny (both dimensions at least ``min_features``): below that the casts cost more than the
  float8 GEMM saves;
* not excluded by ``skip`` (``fnmatch`` patterns of module paths) or by ``filter(path, module)``;
* a plain ``nn.Linear``: a row-parallel Linear with a bias (which adds its bias after the
  all-reduce) keeps its own forward.

Hooks, sync points and schedule records of a converted Linear move to its float8 replacement, so
the order of ``shard`` / ``sync`` / ``float8`` calls does not change what runs.

Example::

    for i in range(n_layers):
        sch[f"model.layers.{i}"].float8(recipe="tensorwise")
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..argument_checks import check_arity
from ..errors import MissingDependencyError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .params import FUNCTION

logger = logging.getLogger("schedlang.primitives.float8")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: the last component of a module path that marks an LM head
HEAD_NAMES = ("lm_head", "output", "embed_out")
#: the dimension the float8 GEMMs need both sides to be a multiple of
ALIGNMENT = 16
DEFAULT_MIN_FEATURES = 128


def torchao_float8():
    """``torchao.float8``, or a MissingDependencyError naming the extra that installs it."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise MissingDependencyError(
            f"float8: training needs torchao, which is not installed ({e}); install the extra: "
            "pip install 'schedlang[fp8]'") from None
    return float8


def hardware_float8() -> bool:
    """Whether this process's GPU has float8 tensor cores (compute capability 8.9 or newer)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _tied_to_embedding(root: nn.Module, weight: torch.Tensor) -> bool:
    return any(isinstance(m, nn.Embedding) and m.weight is weight for m in root.modules())


def skip_reason(root: nn.Module, path: str, module: nn.Module, min_features: int) -> Optional[str]:
    """Why the Linear ``module`` at ``path`` stays in its own dtype, or None when it can be converted."""
    from ..primitives.decompose import LinearWithSeparateBias

    if type(module) is LinearWithSeparateBias:
        return "a row-parallel Linear with a bias (it adds its bias after the all-reduce)"
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} is not a plain nn.Linear"
    out_f, in_f = module.weight.shape
    if path.rpartition(".")[2] in HEAD_NAMES or _tied_to_embedding(root, module.weight):
        return "the LM head (its logits feed the loss; float8 there costs the most accuracy)"
    if in_f % ALIGNMENT or out_f % ALIGNMENT:
        return f"shape ({out_f}, {in_f}) is not divisible by {ALIGNMENT} on both sides"
    if min(in_f, out_f) < min_features:
        return f"tiny ({out_f} x {in_f}, below min_features={min_features}): the casts would cost more than they save"
    return None


def _linears(root: nn.Module, base_path: str, module: nn.Module):
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear):
            path = f"{base_path}.{name}" if base_path and name else (base_path or name)
            yield path, name, child


def _config(recipe: str, fsdp_float8_all_gather: bool, emulate: bool):
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    changes = {"emulate": emulate}
    if fsdp_float8_all_gather:
        changes["enable_fsdp_float8_all_gather"] = True
    import dataclasses

    return dataclasses.replace(config, **changes)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
               "_backward_hooks")


def _move_schedule_state(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the hooks, children (sync points) and schedule records ``old`` carries."""
    for attr in _HOOK_DICTS:
        if hasattr(old, attr):
            getattr(new, attr).update(getattr(old, attr))
    for name, child in old._modules.items():
        new.add_module(name, child)
    for key, value in vars(old).items():
        if key.startswith("_schedlang_"):
            setattr(new, key, value)


@register_primitive
class Float8(Primitive):
    """Train the Linears under this module in float8 (``torchao.float8``; ``pip install 'schedlang[fp8]'``).

    Linears whose dimensions are not multiples of 16, the LM head and Linears smaller than
    ``min_features`` on a side stay in their dtype (the reasons are logged and returned, with the
    paths converted); ``skip`` and ``filter`` exclude more. Call it after ``shard``, so that
    tensor-parallel shards are checked as they will run.

    Example::

        for i in range(n_layers):
            sch[f"model.layers.{i}"].float8(recipe="tensorwise")
    """

    name = "float8"
    params = (
        Param("recipe", str, "tensorwise", "tensorwise (one dynamic scale per tensor), rowwise or rowwise_with_gw_hp"),
        Param("skip", Sequence[str], (), "fnmatch patterns of module paths that stay in their dtype",
              type_error="{where}: float8 skip= takes module-path patterns (str), got {value}"),
        Param("filter", Optional[Callable[[str, nn.Module], bool]], None,
              "filter(path, module) -> bool; False keeps that Linear in its dtype", codec=FUNCTION,
              type_error="{where}: float8 filter= must be a callable filter(path, module) -> bool, got {type_name}"),
        Param("min_features", int, DEFAULT_MIN_FEATURES, "Linears smaller than this on a side stay in their dtype"),
        Param("fsdp_float8_all_gather", bool, False, "FSDP2 all-gathers the weights in float8 (tensorwise only; "
              "build stores their scales after each optimizer step, see schedlang.distributed.float8_fsdp)"),
        Param("emulate", Optional[bool], None,
              "compute the float8 GEMMs in high precision (default: when the GPU has no float8 tensor cores)"),
    )

    @classmethod
    def validate(cls, sch, recipe="tensorwise", skip: Sequence[str] = (), filter: Optional[Callable] = None,
                 min_features: int = DEFAULT_MIN_FEATURES, fsdp_float8_all_gather: bool = False,
                 emulate: Optional[bool] = None):
        where = sch.path or "<root>"
        if recipe not in RECIPES:
            raise ScheduleValueError(f"{where}: unknown float8 recipe {recipe!r}: valid recipes are {', '.join(RECIPES)}")
        if min_features < 1:
            raise ScheduleValueError(f"{where}: float8 min_features must be a positive int, got {min_features!r}")
        if filter is not None:
            check_arity(where, "float8 filter", filter, "(path, module)", ("path", None))
        float8 = torchao_float8()
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ScheduleValueError(f"{where}: fsdp_float8_all_gather=True needs recipe='tensorwise' (torchao casts "
                                     f"whole weights before the all-gather), got recipe={recipe!r}")
        selected, skipped = cls.select(sch, skip, filter, min_features, float8)
        if not selected:
            found = "; ".join(f"{p or '<root>'}: {r}" for p, r in skipped) or "it holds no nn.Linear"
            raise ScheduleValueError(f"{where}: no Linear to convert to float8 ({found}); call float8 on a Linear "
                                     "or on a module that holds some")
        return {"recipe": recipe, "skip": list(skip), "filter": filter, "min_features": min_features,
                "fsdp_float8_all_gather": fsdp_float8_all_gather, "emulate": emulate}

    @classmethod
    def select(cls, sch, skip, filter, min_features, float8=None) -> Tuple[List[str], List[Tuple[str, str]]]:
        """(paths to convert, [(path, reason skipped)]) of the Linears under ``sch``."""
        float8 = float8 or torchao_float8()
        selected, skipped = [], []
        for path, _, module in _linears(sch.root.mod, sch.path, sch.mod):
            if isinstance(module, float8.float8_linear.Float8Linear):
                skipped.append((path, "already float8"))
                continue
            reason = skip_reason(sch.root.mod, path, module, min_features)
            if reason is None and any(fnmatch.fnmatchcase(path, p) for p in skip):
                reason = "excluded by skip="
            if reason is None and filter is not None and not filter(path, module):
                reason = "excluded by filter="
            (skipped.append((path, reason)) if reason else selected.append(path))
        return selected, skipped

    @classmethod
    def apply(cls, sch, recipe, skip, filter, min_features, fsdp_float8_all_gather, emulate):
        float8 = torchao_float8()
        emulate = (not hardware_float8()) if emulate is None else emulate
        config = _config(recipe, fsdp_float8_all_gather, emulate)
        selected, skipped = cls.select(sch, skip, filter, min_features, float8)
        for path, reason in skipped:
            logger.info("float8: %s stays in its dtype: %s", path or "<root>", reason)
        for path in selected:
            old = sch.root.mod.get_submodule(path)
            new = float8.float8_linear.Float8Linear.from_float(old, config=config)
            _move_schedule_state(old, new)
            sch.root[path]._set_module(new)
        logger.info("float8 (%s%s): converted %d Linear(s) under %s", recipe, ", emulated" if emulate else "",
                    len(selected), sch.path or "<root>")
        return {"converted": selected, "skipped": skipped}


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao float8 Linear (without importing torchao)."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")
