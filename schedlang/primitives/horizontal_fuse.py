"""``horizontal_fuse(rules=None, min_group_size=2, example_inputs=None)``: atomic horizontal fusion
on a traced module.

Applies the rules of :mod:`schedlang.graph.passes.horizontal` (parallel linears -> one
GEMM or one batched matmul, layer norms and activations over groups -> one op, split/cat
round trips removed) until nothing changes, and returns the report. The module must
have been traced (``sch.trace()``). ``example_inputs`` (tensors shaped like the traced
forward's inputs) give the rules every node's shape: the graph runs once on fake tensors.
Without them the rules reason from structure, and guard at run time what only the
length of a tensor can tell (the last piece of ``x.split(D, 1)`` may be shorter). The
arguments go into the plan as plain data (example tensors as shape and dtype), so a plan
replays.

Example::

    sch["embeddings_head"].trace()
    report = sch["embeddings_head"].horizontal_fuse(example_inputs=[torch.randn(32, 50 * 64)])
    print(report)
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import fx

from ..errors import NotTracedError, ScheduleValueError
from .base import Param, Primitive, register_primitive
from .params import Codec, DecodeContext

__all__ = ["HorizontalFuse"]


def require_traced(sch, primitive: str) -> fx.GraphModule:
    """``sch.mod`` if it is a traced GraphModule, else a NotTracedError saying what to do."""
    module = sch.mod
    if not isinstance(module, fx.GraphModule):
        where = sch.path or "<root>"
        call = f'sch["{sch.path}"].trace()' if sch.path else "sch.trace()"
        raise NotTracedError(f"{where}: {primitive} needs a traced module, but this is {type(module).__name__}; "
                             f"call {call} first")
    return module


def _valid_rules() -> str:
    from ..graph.passes.horizontal import RULES

    return f"valid rules are {', '.join(RULES)}"


class _ExampleInputsCodec(Codec):
    """Example tensors as ``{"shape": [...], "dtype": "float32"}``, read back as meta tensors."""

    def encode(self, value, where):
        return [{"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for t in value]

    def decode(self, data, ctx: DecodeContext):
        if not isinstance(data, list):
            raise ctx.error(f"expected a list of {{\"shape\": [...], \"dtype\": ...}} objects, got {data!r}")
        out = []
        for item in data:
            shape = item.get("shape") if isinstance(item, dict) else None
            dtype = getattr(torch, item.get("dtype"), None) if isinstance(item, dict) and isinstance(
                item.get("dtype"), str) else None
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(
                    type(d) is int and d >= 0 for d in shape):
                raise ctx.error(f"each example input must be {{\"shape\": [ints >= 0], \"dtype\": \"float32\" (a "
                                f"torch dtype)}}, got {item!r}")
            out.append(torch.empty(shape, dtype=dtype, device="meta"))
        return out

    def describe(self, value):
        from ..graph.passes._shapes import describe_examples

        return describe_examples(value)


@register_primitive
class HorizontalFuse(Primitive):
    """Apply the atomic horizontal-fusion rules to the traced module until nothing changes;
    returns a report of what was fused.

    ``example_inputs`` (tensors shaped like forward's inputs) let the rules use every node's
    shape; without them, what only a tensor's length can tell is checked at run time.

    Example::

        print(sch["heads"].horizontal_fuse(rules=["linear_same_input"]))
    """

    name = "horizontal_fuse"
    params = (
        Param("rules", Optional[Sequence[str]], None, "rule names to apply (None: all)",
              expects="None or a list of rule names", valid=_valid_rules),
        Param("min_group_size", int, 2, "fewest parallel ops worth fusing", expects="an int >= 2"),
        Param("example_inputs", Optional[Sequence[torch.Tensor]], None,
              "tensors shaped like forward's inputs: the rules then know every node's shape", codec=_ExampleInputsCodec(),
              expects="None or a list of tensors"),
    )

    @classmethod
    def validate(cls, sch, rules=None, min_group_size=2, example_inputs=None):
        from ..graph.passes.horizontal import resolve_rules

        where = sch.path or "<root>"
        require_traced(sch, "horizontal_fuse")
        if rules is not None:
            resolve_rules(rules, where)
            rules = list(rules)
        if type(min_group_size) is not int or min_group_size < 2:
            raise ScheduleValueError(f"{where}: horizontal_fuse min_group_size must be an int >= 2, got "
                                     f"{min_group_size!r}")
        if example_inputs is not None:
            from ..graph.passes._shapes import check_example_inputs

            example_inputs = list(check_example_inputs(sch.mod, example_inputs, where))  # shapes and dtypes only
        return {"rules": rules, "min_group_size": min_group_size, "example_inputs": example_inputs}

    @classmethod
    def apply(cls, sch, rules=None, min_group_size=2, example_inputs=None):
        from ..graph.passes.horizontal import horizontal_fuse

        report = horizontal_fuse(sch.mod, rules=rules, min_group_size=min_group_size, path=sch.path,
                                 example_inputs=example_inputs)
        sch.metadata.setdefault("horizontal_fuse", []).append(dict(report.counts))
        return report
