"""``schedlang.build``: turn a schedule into a model ready to train, and its optimizer.

For a model with real weights the working copy is already the scheduled model: build
moves it to ``device`` / ``dtype`` and makes the optimizer. For a model on the meta device
(:func:`schedlang.init_empty_weights`) build allocates every tensor at its *sharded*
size and initializes it so that each shard equals the matching slice of the unsharded
model initialized the same way with the same seed: each module is initialized once at
full size in a temporary copy and cut, so memory holds at most one full module at a time.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import nn

from .distributed.sharding import shard_tensor
from .errors import ScheduleTypeError, ScheduleValueError
from .init import has_meta_tensors

__all__ = ["build"]

logger = logging.getLogger("schedlang.build")


def _default_init(root: nn.Module) -> Callable[[nn.Module], None]:
    hf_init = getattr(root, "_init_weights", None)

    def init(module: nn.Module) -> None:
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        elif hf_init is not None:
            hf_init(module)

    return init


def _materialize_module(module: nn.Module, device, init: Optional[Callable[[nn.Module], None]]) -> None:
    """Allocate ``module``'s own meta tensors on ``device``; initialize at full size and keep this rank's shard."""
    own = [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items())
           if t is not None and t.is_meta]
    if not own:
        return
    specs = getattr(module, "_schedlang_shards", {})
    # a childless shallow copy holding full-size tensors: the init sees the shapes of the unsharded module
    template = copy.copy(module)  # new attribute dict; the tensor dicts are replaced below
    template._modules = {}
    template._parameters = dict(module._parameters)
    template._buffers = dict(module._buffers)
    for n, t in own:
        full = specs[n].full_shape if n in specs else tuple(t.shape)
        data = torch.empty(full, dtype=t.dtype, device=device)
        if n in template._parameters:
            template._parameters[n] = nn.Parameter(data, requires_grad=t.requires_grad)
        else:
            template._buffers[n] = data
    if init is not None:
        with torch.no_grad():
            init(template)
    for n, t in own:
        full = template._parameters[n] if n in template._parameters else template._buffers[n]
        spec = specs.get(n)
        value = full.detach() if spec is None else shard_tensor(full, spec.axis, spec.rank, spec.world_size)
        if n in module._parameters:
            module._parameters[n] = nn.Parameter(value.contiguous(), requires_grad=t.requires_grad)
        else:
            module._buffers[n] = value.contiguous()


def build(sch, init_weights: Union[None, bool, Callable[[nn.Module], None]] = None, optimizer: Any = None,
          device: Union[None, str, torch.device] = None, dtype: Optional[torch.dtype] = None,
          **optimizer_kwargs: Any) -> Tuple[nn.Module, Optional[torch.optim.Optimizer]]:
    """Materialize the schedule's model; returns ``(model, optimizer)``.

    Arguments:
        sch: the schedule (any view; the whole model is built).
        init_weights: for tensors on the meta device: None/True initializes them with each module's
            ``reset_parameters`` (or a HF model's ``_init_weights``), a callable ``fn(module)`` with that,
            False leaves them uninitialized (to load a checkpoint into). On a model with real weights
            a callable is applied to every module; otherwise weights are kept.
        optimizer: None, a name (``"adamw"``, ``"adam"``, ``"sgd"``: schedlang's fused Triton
            optimizers) or an optimizer class such as ``torch.optim.AdamW``.
        device, dtype: where and in which dtype the model ends up.
        **optimizer_kwargs: passed to the optimizer (``lr=...``).

    Example::

        model, opt = schedlang.build(sch, optimizer="adamw", lr=1e-4)
    """
    root = sch.root
    model: nn.Module = root.mod
    if init_weights not in (None, True, False) and not callable(init_weights):
        raise ScheduleTypeError(f"build: init_weights must be None, a bool or a callable fn(module), got "
                                f"{init_weights!r}")
    if optimizer_kwargs and optimizer is None:
        raise ScheduleValueError(f"build: optimizer options {sorted(optimizer_kwargs)} given without optimizer=")
    if has_meta_tensors(model):
        target = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        init = None if init_weights is False else (init_weights if callable(init_weights) else _default_init(model))
        for module in model.modules():
            _materialize_module(module, target, init)
        logger.info("materialized meta tensors on %s", target)
    elif callable(init_weights):
        with torch.no_grad():
            model.apply(init_weights)
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    from .primitives.annotate import apply_annotations

    for module in model.modules():
        apply_annotations(module)
    opt = None
    if optimizer is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        if isinstance(optimizer, str):
            from .optim import make_optimizer

            opt = make_optimizer(optimizer, params, **optimizer_kwargs)
        elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            opt = optimizer(params, **optimizer_kwargs)
        else:
            raise ScheduleTypeError(f"build: optimizer must be a name ('adamw', 'adam', 'sgd') or a "
                                    f"torch.optim.Optimizer class, got {optimizer!r}")
    return model, opt
