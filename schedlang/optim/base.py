"""What the fused optimizers share: argument checks, local tensors, launch buckets, state loading.

A fused optimizer is a ``torch.optim.Optimizer`` whose ``step`` gathers, for every parameter
group, the parameters that have a gradient, sorts them into *buckets* (one per device,
parameter dtype and gradient dtype: one Triton launch each) and hands each bucket to a
multi-tensor kernel of :mod:`schedlang.kernels`. The launch tables of a bucket are kept in a
:class:`~schedlang.kernels.multi_tensor_apply.ChunkTables` between steps.

DTensor parameters are updated through their local shard (their state is a DTensor laid out like
the parameter, as torch.optim makes it), so DTensor and plain parameters mix freely in a group.
"""

from __future__ import annotations

import logging
from itertools import chain

import torch

from schedlang.errors import ScheduleTypeError, ScheduleValueError

__all__ = ["FusedOptimizer", "SUPPORTED_DTYPES"]

logger = logging.getLogger("schedlang.optim")

#: parameter (and gradient) dtypes the kernels update; optimizer state is always fp32
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)

_DTENSOR = []  # the DTensor class, imported on first use (torch.distributed may be absent)


def _dtensor_class():
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except Exception:  # a torch built without distributed
            DTensor = ()
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def local_tensor(t: torch.Tensor, dtensor_class=None) -> torch.Tensor:
    """The tensor a kernel updates: the local shard of a DTensor, else ``t`` itself."""
    cls = dtensor_class if dtensor_class is not None else _dtensor_class()
    if cls and isinstance(t, cls):
        return t._local_tensor
    return t


def fp32_state_like(p: torch.Tensor) -> torch.Tensor:
    """A zero fp32 tensor laid out like ``p`` (a DTensor for a DTensor parameter)."""
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


def _is_number_like(x) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of :class:`FusedAdam`, :class:`FusedAdamW` and :class:`FusedSGD`.

    Subclasses set ``_state_tensor_keys`` (state entries kept as fp32 tensors shaped like the
    parameter), implement ``_check_group(group, where)`` (raise on bad hyperparameters) and
    ``_step_group(group_index, group, entries)`` where ``entries`` lists ``(param, grad)`` pairs
    of the group's parameters that have a gradient.
    """

    _state_tensor_keys: tuple[str, ...] = ()

    def _check_hyperparameters(self, group: dict, where: str) -> None:
        """Raise on a bad learning rate, weight decay or flag; subclasses add their own."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ScheduleValueError(f"Tensor lr must be 1-element{where}, got shape {tuple(lr.shape)}")
        if not _is_number_like(lr):
            raise ScheduleTypeError(f"Invalid learning rate: {lr!r}{where}: expected a float or a 1-element tensor")
        if not 0.0 <= lr:
            raise ScheduleValueError(f"Invalid learning rate: {float(lr)}{where}: must be >= 0")
        wd = group["weight_decay"]
        if not _is_number_like(wd):
            raise ScheduleTypeError(f"Invalid weight_decay value: {wd!r}{where}: expected a float")
        if not 0.0 <= wd:
            raise ScheduleValueError(f"Invalid weight_decay value: {float(wd)}{where}: must be >= 0")
        if group.get("differentiable", False):
            raise ScheduleValueError(
                f"{type(self).__name__} does not support differentiable=True{where}: its update runs in a "
                f"Triton kernel that autograd cannot see; use torch.optim.{self._torch_name}(differentiable=True)")
        self._check_group(group, where)

    def _check_params(self, params: list, where: str) -> None:
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise ScheduleTypeError(f"{type(self).__name__}: parameter {i}{where} is a "
                                        f"{type(p).__name__}, not a tensor")
            if p.dtype not in SUPPORTED_DTYPES:
                raise ScheduleTypeError(
                    f"{type(self).__name__}: parameter {i}{where} has dtype {p.dtype}; the fused kernels "
                    f"update {_DTYPE_NAMES} parameters")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, after checking its hyperparameters as the constructor does."""
        params = param_group["params"]
        if isinstance(params, set):
            return super().add_param_group(param_group)  # torch.optim says why sets are refused
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        where = f" (param group {len(self.param_groups)})" if self.param_groups else ""
        self._check_hyperparameters({**self.defaults, **param_group}, where)
        # named parameters come as (name, tensor) pairs
        self._check_params([p[1] if isinstance(p, tuple) else p for p in params], where)
        super().add_param_group({**param_group, "params": params})

    def _check_group(self, group: dict, where: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- stepping -------------------------------------------------------------------------

    def _chunk_tables(self, key):
        from schedlang.kernels.multi_tensor_apply import ChunkTables

        cache = self.__dict__.setdefault("_schedlang_chunk_tables", {})
        tables = cache.get(key)
        if tables is None:
            tables = cache[key] = ChunkTables()
        return tables

    @staticmethod
    def _lr_argument(lr, device: torch.device):
        """lr as the kernel takes it: a device tensor stays one (read in the kernel)."""
        if isinstance(lr, torch.Tensor):
            if lr.device == device:
                return lr
            return lr.item()  # a CPU tensor: a host read, no wait on the device
        return float(lr)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step over every parameter that has a gradient.

        Example::

            loss = model(x).sum(); loss.backward()
            optimizer.step()
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # check every gradient before any state is created or any tensor is written
        work = []
        for gi, group in enumerate(self.param_groups):
            entries = []
            for i, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ScheduleValueError(
                        f"{type(self).__name__} does not support sparse gradients (parameter {i} of "
                        f"param group {gi} has a {grad.layout} gradient); use torch.optim.SparseAdam or "
                        f"dense gradients (e.g. nn.Embedding(sparse=False))")
                if grad.dtype not in SUPPORTED_DTYPES:
                    raise ScheduleTypeError(
                        f"{type(self).__name__}: the gradient of parameter {i} of param group {gi} has "
                        f"dtype {grad.dtype}; the fused kernels read {_DTYPE_NAMES} gradients")
                entries.append((p, grad))
            work.append(entries)
        for gi, (group, entries) in enumerate(zip(self.param_groups, work)):
            if entries:
                self._step_group(gi, group, entries)
        return loss

    def _buckets(self, entries, states_of):
        """Sort ``(param, grad)`` pairs into launch buckets keyed by (device, dtypes).

        ``states_of(param, state)`` returns the tuple of state tensors the kernel needs; the
        bucket holds a list per position: locals of params, grads, then of each state tensor.
        """
        dtensor = _dtensor_class()
        buckets = {}
        state = self.state
        for p, g in entries:
            lp = local_tensor(p, dtensor)
            lg = local_tensor(g, dtensor)
            key = (lp.device, lp.dtype, lg.dtype)
            lists = buckets.get(key)
            extra = states_of(p, state[p])
            if lists is None:
                lists = buckets[key] = [[] for _ in range(2 + len(extra))]
            lists[0].append(lp)
            lists[1].append(lg)
            for lst, t in zip(lists[2:], extra):
                lst.append(local_tensor(t, dtensor) if isinstance(t, torch.Tensor) else t)
        return buckets

    # -- state dict -----------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of the matching ``torch.optim`` class.

        State tensors are kept in fp32 on the parameter's device (torch.optim would cast them
        to the parameter's dtype: lossy for bf16 parameters) and ``step`` becomes a 0-d fp32
        tensor on that device, read by the kernel.

        Example::

            fused.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
        """
        stash = {}

        def keep_original(optimizer, sd):
            stash["sd"] = sd

        # runs after any user pre-hook: it sees the dict that is really loaded
        handle = self.register_load_state_dict_pre_hook(keep_original)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
        saved = stash.get("sd", state_dict)
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved["param_groups"]),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for key, values in saved["state"].items():
            param = id_map.get(key)
            if param is None:
                continue
            state = self.state[param]
            for name in self._state_tensor_keys:
                value = values.get(name)
                if isinstance(value, torch.Tensor):
                    state[name] = value.detach().to(device=param.device, dtype=torch.float32, copy=True)
                elif name in state and value is None:
                    del state[name]
            if "step" in values:
                step = values["step"]
                step = step.detach() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
                state["step"] = step.to(device=local_tensor(param).device, dtype=torch.float32, copy=True)
        self.__dict__.pop("_schedlang_chunk_tables", None)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
