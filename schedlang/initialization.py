"""Building models without allocating their weights, under Slapo's names.

``init_empty_weights()`` puts parameters on the meta device (see :mod:`schedlang.init`, which it
uses); ``init_on_device(device)`` puts them on any device, e.g. straight onto the GPU.

Example::

    with init_empty_weights():
        model = GPT2LMHeadModel(config)       # no weight memory
    with init_on_device("cuda"):
        model = GPT2LMHeadModel(config)       # weights created on the GPU, not copied there
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Union

import torch
from torch import nn

from . import init as _init

__all__ = ["init_empty_weights", "init_on_device"]


@contextlib.contextmanager
def init_empty_weights(enable: bool = True, include_buffers: bool = False) -> Iterator[None]:
    """Create parameters (and buffers too, with ``include_buffers``) on the meta device;
    ``enable=False`` makes it a no-op, for code that decides at run time."""
    if not enable:
        yield
        return
    with _init.init_empty_weights(include_buffers=include_buffers):
        yield


@contextlib.contextmanager
def init_on_device(device: Union[str, torch.device], include_buffers: bool = False) -> Iterator[None]:
    """Create parameters (and with ``include_buffers`` every tensor a constructor makes) on ``device``."""
    device = torch.device(device)
    if include_buffers:
        with torch.device(device):
            yield
        return
    original = nn.Module.register_parameter

    def register_on_device(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and param.device != device:
            moved = type(param)(param.detach().to(device), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_device
    try:
        yield
    finally:
        nn.Module.register_parameter = original
