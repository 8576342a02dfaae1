"""``annotate(param_name, key, value)``: attach metadata to a parameter.

The value is set as an attribute of the parameter (``param.<key>``, as Slapo does) and
recorded in the module's record (``annotations``), so it survives copies, replay and ``build``. Useful to mark
parameters for an optimizer or a checkpoint converter (e.g. their original shape).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from ..module_record import module_record, update_record
from .base import Param, Primitive, register_primitive

_RESERVED = {"data", "grad", "requires_grad", "shape", "dtype", "device"}


def apply_annotations(module) -> None:
    """Set recorded annotations as attributes of the module's (current) parameters, and Slapo's
    ``orig_shape`` (the unsharded shape, a ``torch.Size``) on each of its sharded parameters."""
    record = module_record(module)
    for pname, spec in record.shards.items():
        param = module._parameters.get(pname)
        if param is not None:
            param.orig_shape = torch.Size(spec.full_shape)
    for pname, kv in record.annotations.items():
        param = module._parameters.get(pname)
        if param is not None:
            for key, value in kv.items():
                setattr(param, key, value)


@register_primitive
class Annotate(Primitive):
    """Attach ``key = value`` to parameter ``param_name`` (kept through build and replay).

    Example::

        sch["fc1"].annotate("weight", "orig_shape", (20, 12))
    """

    name = "annotate"
    params = (
        Param("param_name", str, doc="a parameter of this module"),
        Param("key", str, doc="attribute name to set on the parameter (an identifier)",
              type_error="{where}: annotation key must be an identifier string, got {value}"),
        Param("value", Any, doc="the value (plain data, to be written to a plan's JSON)"),
    )

    @classmethod
    def validate(cls, sch, param_name, key, value):
        where = sch.path or "<root>"
        params = [n for n, _ in sch.mod.named_parameters(recurse=False)]
        if param_name not in params:
            raise ScheduleKeyError(f"{where}: no parameter '{param_name}' to annotate; valid names: "
                                   f"{', '.join(params) if params else 'none (it owns no parameters)'}")
        if not key.isidentifier():
            raise ScheduleTypeError(f"{where}: annotation key must be an identifier string, got {key!r}")
        if key in _RESERVED or key.startswith("_") or hasattr(nn.Parameter, key):
            # a tensor's own attributes and methods: some cannot be set at all (T, is_leaf), and the rest would
            # silently replace what torch and the model call on the parameter (size, add, view ...)
            raise ScheduleValueError(f"{where}: annotation key {key!r} would shadow a tensor attribute; choose "
                                     "another name")
        return {"param_name": param_name, "key": key, "value": value}

    @classmethod
    def apply(cls, sch, param_name, key, value):
        module = sch.mod
        notes = {k: dict(v) for k, v in module_record(module).annotations.items()}
        notes.setdefault(param_name, {})[key] = value
        update_record(module, annotations=notes)
        setattr(getattr(module, param_name), key, value)
        return None
