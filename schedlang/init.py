"""Creating models without memory: ``schedlang.init_empty_weights()``.

Inside the context every parameter a module registers is put on the meta device (shape
and dtype only, no storage). Buffers stay real, because models compute some of them in
``__init__`` (rotary frequencies, position ids) and could not recompute them later.
``schedlang.build`` later allocates and initializes only each rank's shards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["init_empty_weights", "has_meta_tensors"]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build modules with parameters on the meta device.

    Example::

        with schedlang.init_empty_weights():
            model = LlamaForCausalLM(config)      # no memory allocated for weights
        sch = schedlang.create_schedule(model)    # shard, sync ...
        model, _ = schedlang.build(sch, device="cuda")  # each rank allocates only its shards
    """
    if include_buffers:
        with torch.device("meta"):
            yield
        return
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.detach().to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))
