"""``context_parallel()``: split the sequence of a causal LM's inputs over the mesh's ``cp`` dimension.

Applied to a Hugging Face causal LM (usually the root), every forward takes the full ``[b, L]`` batch on
each ``cp`` rank and keeps this rank's ``L / cp`` tokens (chunks ``r`` and ``2cp - 1 - r`` of ``2cp``,
so causal attention costs the same on every rank), with ``position_ids`` the global positions. Every
attention under the module runs :func:`schedlang.distributed.context_parallel.context_parallel_attention`
(all-gathered K/V, a mask from global positions: causal, sliding windows included). The logits stay
split: this rank's tokens, in local order (``gather_sequence`` puts them back in global order).

The loss is computed with :func:`schedlang.context_parallel_loss` from the full labels, never inside the
model (``labels=`` is refused). Padding masks are refused: pass sequences without padding.

Example::

    mesh = make_mesh(cp=2)
    sch = schedlang.create_schedule(model, mesh=mesh)
    sch.context_parallel()
    logits = sch.mod(input_ids).logits                     # [b, L / 2, V] on each rank
    loss = schedlang.context_parallel_loss(logits, input_ids, sch.mod)
"""

from __future__ import annotations

import inspect
from typing import Any, Dict

from ..distributed import context_parallel as cp_engine
from ..errors import ScheduleValueError, UnsupportedModelError
from .base import Primitive, register_primitive

#: the attention implementations whose numerics the context-parallel function reproduces
SUPPORTED_ATTENTION = ("sdpa", "eager")
#: the kinds of layers (``config.layer_types``) whose only exchange between tokens is attention
ATTENTION_LAYERS = ("full_attention", "sliding_attention")


def _refuse(where: str, what: str):
    return UnsupportedModelError(f"{where}: context_parallel cannot split this model: {what}")


def _cp_group(sch, where: str) -> cp_engine.ContextParallelGroup:
    mesh = sch.mesh
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "cp" not in names:
        raise ScheduleValueError(
            f"{where}: context_parallel splits the sequence over the mesh's 'cp' dimension, and the schedule's mesh "
            f"has {('dimensions ' + ', '.join(names)) if names else 'no mesh'}; create the schedule with "
            f"mesh=make_mesh(cp=N, ...)")
    sub = mesh["cp"]
    return cp_engine.ContextParallelGroup(sub.get_group(), sub.size(), sub.get_local_rank())


@register_primitive
class ContextParallel(Primitive):
    """Split the sequence of this causal LM's inputs over the mesh's ``cp`` ranks (load-balanced for
    causal attention); attention all-gathers keys and values over ``cp``. Logits stay split; compute the
    loss with :func:`schedlang.context_parallel_loss` (see :mod:`schedlang.primitives.context_parallel`).

    Example::

        sch = schedlang.create_schedule(model, mesh=make_mesh(cp=2))
        sch.context_parallel()
    """

    name = "context_parallel"
    params = ()

    @classmethod
    def validate(cls, sch) -> Dict[str, Any]:
        where = sch.path or "<root>"
        module = sch.mod
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if impl == cp_engine.ATTENTION_NAME:
            raise ScheduleValueError(f"{where}: context_parallel was already applied to this model; call it "
                                     f"once, on the model's root")
        if config is None or impl not in SUPPORTED_ATTENTION:
            raise _refuse(where, f"its attention implementation is {impl!r}; context parallelism reproduces "
                                 f"{' or '.join(map(repr, SUPPORTED_ATTENTION))} (set config._attn_implementation)")
        kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYERS))
        if kinds:
            raise _refuse(where, f"its layers of kind {', '.join(kinds)} mix tokens outside attention; only "
                                 f"{' and '.join(ATTENTION_LAYERS)} layers are split")
        found = cp_engine.attention_modules(module)
        if not found:
            raise _refuse(where, "no attention module under it dispatches through transformers' "
                                 "ALL_ATTENTION_FUNCTIONS")
        for path, attention in found:
            if any(name in ("sinks", "s_aux") for name, _ in attention.named_parameters(recurse=False)):
                raise _refuse(_join(where, path), "attention sinks (a learned score every query adds to its "
                                                  "softmax) are not supported")
        names = list(inspect.signature(module.forward).parameters)
        if "position_ids" not in names:
            raise _refuse(where, f"its forward takes no position_ids (arguments: {', '.join(names)})")
        _cp_group(sch, where)
        return {}

    @classmethod
    def apply(cls, sch) -> None:
        where = sch.path or "<root>"
        module = sch.mod
        cp_group = _cp_group(sch, where)
        cp_engine.register_attention()
        for _, attention in cp_engine.attention_modules(module):
            attention._schedlang_context_parallel = cp_group
        module._schedlang_context_parallel = cp_group
        module.config._attn_implementation = cp_engine.ATTENTION_NAME
        names = list(inspect.signature(module.forward).parameters)
        module.register_forward_pre_hook(cp_engine.SplitInputs(names, cp_group, where), with_kwargs=True)
        return None


def _join(where: str, path: str) -> str:
    return path if where == "<root>" else f"{where}.{path}" if path else where
