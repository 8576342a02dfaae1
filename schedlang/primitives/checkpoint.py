"""``checkpoint(subgraph=None)``: activation checkpointing.

The module's forward runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
RNG state preserved, so dropout recomputes the same mask): its activations are freed
after forward and recomputed in backward. With ``subgraph`` (from ``find`` on a traced
module) only that part is checkpointed.
"""

from __future__ import annotations

import types

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from typing import Any

from ..errors import ScheduleValueError
from ..module_record import module_record, update_record
from .base import Param, Primitive, register_primitive
from .params import SUBGRAPHS


def _determinism_checks():
    """The values torch.utils.checkpoint accepts for ``determinism_check`` (its table where this torch has one)."""
    table = getattr(torch_checkpoint, "_allowed_determinism_checks_to_fns", None)
    return tuple(table) if table else ("default", "none")


def _checkpointed_forward(self, *args, **kwargs):
    # the class's forward, looked up at call time, so a later class change (decompose) is honoured
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return torch_checkpoint.checkpoint(_with_hoisted_local_views, forward, self, *args, use_reentrant=False,
                                       **module_record(self).checkpoint_options, **kwargs)


def _with_hoisted_local_views(forward, module, *args, **kwargs):
    # a compiled tensor-parallel layer swaps its DTensors for local tensors around its call, in hooks
    # (schedlang.distributed.dtensor_params.hoist_local_views); the recompute in the backward runs the forward
    # without them, and must see the same local tensors
    from ..distributed.dtensor_params import hoisted_local_views

    with hoisted_local_views(module):
        return forward(module, *args, **kwargs)


@register_primitive
class Checkpoint(Primitive):
    """Recompute this module's activations in backward (``torch.utils.checkpoint``, non-reentrant);
    with ``subgraph`` (from :meth:`find`), only that part of the traced module.

    Example::

        for i in range(n_layers): sch[f"layers.{i}"].checkpoint()
    """

    name = "checkpoint"
    params = (
        Param("subgraph", Any, None, "subgraphs found in this traced module (None: the whole module)",
              codec=SUBGRAPHS),
        Param("preserve_rng_state", bool, True, "restore the RNG state when recomputing (torch's default)",
              option=True),
        Param("determinism_check", str, "default", "torch.utils.checkpoint's check of recomputed values",
              option=True),
    )

    @classmethod
    def validate(cls, sch, subgraph=None, **options):
        where = sch.path or "<root>"
        determinism_check = options.get("determinism_check")
        if determinism_check is not None and determinism_check not in _determinism_checks():
            # torch checks it only at the first forward with gradients, far from this call
            raise ScheduleValueError(f"{where}: unknown checkpoint determinism_check {determinism_check!r}: valid "
                                     f"values are {', '.join(map(repr, _determinism_checks()))}")
        if subgraph is not None:
            from .. import graph

            return {"subgraph": graph.validate_subgraphs(sch, subgraph, "checkpoint"), **options}
        if not sch.path:
            raise ScheduleValueError("<root>: checkpointing the whole model saves nothing (every activation is "
                                     "recomputed at once); checkpoint its layers, e.g. sch['layers.0'].checkpoint()")
        if module_record(sch.mod).checkpointed:
            raise ScheduleValueError(f"{where}: already checkpointed; checkpoint each module only once")
        return {"subgraph": None, **options}

    @classmethod
    def apply(cls, sch, subgraph=None, **options):
        if subgraph is not None:
            from .. import graph

            return graph.checkpoint_subgraph(sch, subgraph)
        module: nn.Module = sch.mod
        update_record(module, checkpointed=True, checkpoint_options=dict(options))
        module.forward = types.MethodType(_checkpointed_forward, module)
        return None
