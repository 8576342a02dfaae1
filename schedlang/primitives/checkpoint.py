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

from ..errors import ScheduleValueError
from .base import Primitive, register_primitive

_OPTIONS = ("preserve_rng_state", "determinism_check")


def _checkpointed_forward(self, *args, **kwargs):
    # the class's forward, looked up at call time, so a later class change (decompose) is honoured
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return torch_checkpoint.checkpoint(forward, self, *args, use_reentrant=False,
                                       **self._schedlang_checkpoint_options, **kwargs)


@register_primitive
class Checkpoint(Primitive):
    name = "checkpoint"

    @classmethod
    def validate(cls, sch, subgraph=None, **options):
        where = sch.path or "<root>"
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ScheduleValueError(f"{where}: unknown checkpoint option(s) {', '.join(unknown)}: valid options are "
                                     f"{', '.join(_OPTIONS)}")
        if subgraph is not None:
            from .. import graph

            return {"subgraph": graph.validate_subgraphs(sch, subgraph, "checkpoint"), **options}
        if not sch.path:
            raise ScheduleValueError("<root>: checkpointing the whole model saves nothing (every activation is "
                                     "recomputed at once); checkpoint its layers, e.g. sch['layers.0'].checkpoint()")
        if getattr(sch.mod, "_schedlang_checkpointed", False):
            raise ScheduleValueError(f"{where}: already checkpointed")
        return {"subgraph": None, **options}

    @classmethod
    def apply(cls, sch, subgraph=None, **options):
        if subgraph is not None:
            from .. import graph

            return graph.checkpoint_subgraph(sch, subgraph)
        module: nn.Module = sch.mod
        module._schedlang_checkpointed = True
        module._schedlang_checkpoint_options = dict(options)
        module.forward = types.MethodType(_checkpointed_forward, module)
        return None

    @classmethod
    def replay_args(cls, args):
        args = dict(args)
        if args.get("subgraph") is not None:
            from .. import graph

            args["subgraph"] = graph.decode_subgraphs(graph.encode_subgraphs(args["subgraph"]))
        return args

    @classmethod
    def encode_args(cls, args, step_index, path):
        args = dict(args)
        if args.get("subgraph") is not None:
            from .. import graph

            args["subgraph"] = graph.encode_subgraphs(args["subgraph"])
        return super().encode_args(args, step_index, path)

    @classmethod
    def decode_args(cls, data):
        data = dict(data)
        if data.get("subgraph") is not None:
            from .. import graph

            data["subgraph"] = graph.decode_subgraphs(data["subgraph"])
        return data
