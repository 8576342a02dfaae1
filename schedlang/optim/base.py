"""What the fused optimizers share: argument checks, local tensors, launch buckets, state loading.

A fused optimizer is a ``torch.optim.Optimizer`` whose ``step`` gathers, for every parameter
group, the parameters that have a gradient, sorts them into *buckets* (one per device,
parameter dtype and gradient dtype: one Triton launch each) and hands each bucket to a
multi-tensor kernel of :mod:`schedlang.kernels`. The launch tables of a bucket are kept in a
:class:`~schedlang.kernels.multi_tensor_apply.ChunkTables` between steps.

DTensor parameters are updated through their local shard (their state is a DTensor laid out like
the parameter, as torch.optim makes it), so DTensor and plain parameters mix freely in a group. A
DTensor gradient laid out otherwise than its parameter (``Replicate`` or ``Partial`` for a sharded
weight) is first redistributed to the parameter's placements, as torch.optim's DTensor ops do.
torchao's float8 weights under FSDP2 are updated through the tensor they wrap; any other tensor
subclass goes through the kernels' PyTorch reference, whose ops it dispatches itself.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable
from itertools import chain, compress, repeat

import torch

from schedlang.errors import ArgumentTypeError, ScheduleTypeError, ScheduleValueError

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


def _holds_values_inside(t: torch.Tensor) -> bool:
    """torchao's float8 weight under FSDP2 (``WeightWithDynamicFloat8CastTensor``): a wrapper whose values are
    its ``_tensor``, on which it runs every op, in-place ones included (named here so that torchao need not be
    imported). Other tensor subclasses are left whole: the kernels send them through the reference."""
    cls = type(t)
    return (cls.__name__ == "WeightWithDynamicFloat8CastTensor" and cls.__module__.startswith("torchao.")
            and isinstance(getattr(t, "_tensor", None), torch.Tensor) and t._tensor.shape == t.shape)


def local_tensor(t: torch.Tensor, dtensor_class=None) -> torch.Tensor:
    """The tensor a kernel updates: the local shard of a DTensor, and within it the values of torchao's float8
    weight wrapper; else ``t`` itself."""
    cls = dtensor_class if dtensor_class is not None else _dtensor_class()
    if cls and isinstance(t, cls):
        t = t._local_tensor
    if _holds_values_inside(t):
        t = t._tensor
    return t


def fp32_state_like(p: torch.Tensor) -> torch.Tensor:
    """A zero fp32 tensor laid out like ``p`` (a DTensor for a DTensor parameter)."""
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


def _is_number_like(x) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


def _param_list(owner: str, params) -> list:
    """``params`` (tensors, ``(name, tensor)`` pairs or param-group dicts) as the list torch.optim would make of
    it, or an error naming the optimizer: torch.optim's own ("'int' object is not iterable", "optimizer got an
    empty parameter list") name neither the optimizer nor what to pass."""
    if isinstance(params, torch.Tensor):
        raise ArgumentTypeError(f"{owner}: params must be an iterable of tensors or param-group dicts, got one "
                                f"tensor of shape {tuple(params.shape)}; pass a list of it ([tensor]) or "
                                "model.parameters()")
    if not isinstance(params, Iterable) or isinstance(params, (str, bytes)):
        raise ArgumentTypeError(f"{owner}: params must be an iterable of tensors or param-group dicts (e.g. "
                                f"model.parameters()), got {type(params).__name__}")
    params = list(params)
    if not params:
        raise ScheduleValueError(f"{owner}: params is empty: pass the tensors to update (e.g. model.parameters() of "
                                 "a model that has parameters), or param-group dicts")
    return params


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of :class:`FusedAdam`, :class:`FusedAdamW` and :class:`FusedSGD`.

    Subclasses set ``_state_tensor_keys`` (state entries kept as fp32 tensors shaped like the
    parameter) and implement ``_check_group(group, where)`` (raise on bad hyperparameters),
    ``_states_of``, ``_make_launcher`` and ``_launch`` (see the stepping section below).

    ``step`` keeps, per param group, a plan: the launchers of its buckets (device tables built
    once) and what they assume. A step whose plan still holds costs a few passes over the
    parameter list in C plus the launches; otherwise the plan is rebuilt (and the device tables
    too when an address changed).
    """

    _state_tensor_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict) -> None:
        super().__init__(_param_list(type(self).__name__, params), defaults)

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
                                        f"{type(p).__name__}, not a tensor; pass tensors such "
                                        "as model.parameters()")
            if p.dtype not in SUPPORTED_DTYPES:
                raise ScheduleTypeError(
                    f"{type(self).__name__}: parameter {i}{where} has dtype {p.dtype}; the fused kernels "
                    f"update only {_DTYPE_NAMES} parameters")

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

    # subclass hooks
    def _plan_flags(self, group: dict) -> tuple:
        """Group settings that change what the launch tables hold (e.g. amsgrad)."""
        return ()

    def _checked_state_keys(self, group: dict) -> tuple:
        """State entries whose tensors the launch tables point at."""
        return ()

    def _states_of(self, group: dict):
        """``(param, state_mapping) -> tuple`` of what the launcher takes per tensor.

        Creates missing state; ``state_mapping`` is ``self.state`` (a defaultdict: reading an
        entry creates it, so an optimizer without state, SGD without momentum, leaves it alone).
        """
        raise NotImplementedError

    def _make_launcher(self, lists, tables):
        raise NotImplementedError

    def _launch(self, launcher, grads, group: dict, device: torch.device) -> None:
        raise NotImplementedError

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
        plans = self.__dict__.setdefault("_schedlang_plans", {})
        # first check everything, so that an error leaves every tensor and the state unchanged
        work = []
        for gi, group in enumerate(self.param_groups):
            plan = plans.get(gi)
            grads = plan.grads_if_valid(self, group) if plan is not None else None
            if grads is not None:
                work.append((gi, group, plan, grads))
            else:
                work.append((gi, group, None, self._checked_entries(gi, group)))
        for gi, group, plan, payload in work:
            if plan is None:
                if not payload:
                    plans.pop(gi, None)
                    continue
                plan, payload = self._build_plan(gi, group, payload)
                plans[gi] = plan
            plan.launch(self, group, payload)
        return loss

    def _checked_entries(self, gi: int, group: dict):
        entries = []
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise ScheduleValueError(
                    f"{type(self).__name__}: sparse gradients are not supported (parameter {i} of "
                    f"param group {gi} has a {grad.layout} gradient); use torch.optim.SparseAdam or "
                    f"dense gradients (e.g. nn.Embedding(sparse=False))")
            if grad.dtype not in SUPPORTED_DTYPES:
                raise ScheduleTypeError(
                    f"{type(self).__name__}: the gradient of parameter {i} of param group {gi} has "
                    f"dtype {grad.dtype}; the fused kernels read only {_DTYPE_NAMES} gradients")
            entries.append((p, self._grad_laid_out_like(p, grad, i, gi)))
        return entries

    def _grad_laid_out_like(self, p: torch.Tensor, grad: torch.Tensor, i: int, gi: int) -> torch.Tensor:
        """``grad`` with ``p``'s layout: the kernels pair each parameter's local shard with its gradient's.

        A DTensor gradient can come out of the backward laid out otherwise than its parameter: torch's
        ``RowwiseParallel`` embedding, for one, gives its ``Shard(0)`` weight a ``Replicate`` gradient, and a
        ``Partial`` gradient is a sum not yet taken. torch.optim's DTensor ops bring such a gradient to the
        parameter's placements before updating; so does this (slicing a replicated gradient, reducing a
        partial one: a collective, which every rank makes for the same parameters in the same order). Read
        as it is, the local tensor would pair shard ``k`` of the parameter with other rows of the gradient."""
        dtensor = _dtensor_class()
        if not dtensor or (not isinstance(p, dtensor) and not isinstance(grad, dtensor)):
            return grad
        owner, where = type(self).__name__, f"parameter {i} of param group {gi}"
        if not isinstance(p, dtensor) or not isinstance(grad, dtensor):
            def kind(t):
                return "a DTensor" if isinstance(t, dtensor) else "a plain tensor"

            raise ScheduleTypeError(
                f"{owner}: {where} is {kind(p)} (shape {tuple(p.shape)}) but its gradient is {kind(grad)}; a "
                "DTensor parameter needs a DTensor gradient and a plain one a plain gradient (was .grad set by hand?)")
        if grad.device_mesh != p.device_mesh:
            raise ScheduleValueError(
                f"{owner}: the gradient of {where} lives on mesh {grad.device_mesh}, the parameter on "
                f"{p.device_mesh}; a gradient must be on its parameter's mesh")
        if tuple(grad.placements) != tuple(p.placements):
            logger.debug("%s: the gradient of %s is laid out as %s, its parameter as %s; redistributed",
                         owner, where, grad.placements, p.placements)
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad  # same mesh, placements and (as .grad enforces) shape: the same local shape

    def _build_plan(self, gi: int, group: dict, entries):
        """Create missing state, sort tensors into buckets, prepare one launcher per bucket."""
        dtensor = _dtensor_class()
        states_of = self._states_of(group)
        state = self.state
        buckets = {}
        any_dtensor = False
        for position, (p, g) in enumerate(entries):
            lp = local_tensor(p, dtensor)
            lg = local_tensor(g, dtensor)
            any_dtensor = any_dtensor or lp is not p or lg is not g
            key = (lp.device, lp.dtype, lg.dtype)
            extra = states_of(p, state)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = ([], [[] for _ in range(2 + len(extra))])
            bucket[0].append(position)
            lists = bucket[1]
            lists[0].append(lp)
            lists[1].append(lg)
            for lst, t in zip(lists[2:], extra):
                lst.append(local_tensor(t, dtensor) if isinstance(t, torch.Tensor) else t)
        launches = []
        for key, (positions, lists) in buckets.items():
            launcher = self._make_launcher(lists, self._chunk_tables((gi,) + key))
            launches.append((key[0], launcher, positions if len(buckets) > 1 else None))
        plan = _GroupPlan(self, group, entries, launches, fast=not any_dtensor)
        logger.debug("%s: launch plan of param group %d built (%d tensors, %d buckets)",
                     type(self).__name__, gi, len(entries), len(launches))
        return plan, [local_tensor(g, dtensor) for _, g in entries]

    # -- state dict -----------------------------------------------------------------------

    def _check_state_dict_to_load(self, state_dict: dict) -> None:
        """Raise if ``state_dict`` cannot be loaded; runs before anything changes.

        Every per-element state tensor (moments, momentum buffers, masters: anything not 0-d, as ``step``
        is) must have its parameter's shape: the kernels read and write a state as long as its parameter,
        so a state of another model's parameter would be read past its end."""
        owner = type(self).__name__
        saved_state = state_dict.get("state", {})
        for gi, (saved, group) in enumerate(zip(state_dict.get("param_groups", ()), self.param_groups)):
            for i, (key, p) in enumerate(zip(saved.get("params", ()), group["params"])):
                for name, value in saved_state.get(key, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                        raise ScheduleValueError(
                            f"{owner}.load_state_dict: state {name!r} of parameter {i} of param group {gi} has "
                            f"shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; each state must match "
                            "its parameter's shape (was the state dict saved for another model?)")

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
            optimizer._check_state_dict_to_load(sd)  # before anything is loaded
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
        self.__dict__.pop("_schedlang_plans", None)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)


_get_grad = operator.attrgetter("grad")
_get_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr


class _GroupPlan:
    """The launchers of one param group, and what must hold for them to be reused.

    Reuse needs the same parameter list with gradients on the same parameters, every gradient
    and parameter at its recorded address with its recorded dtype, the same state tensors and
    the same table-shaping settings. Checking that is a few C-level passes over the list, much
    cheaper than gathering everything again. Groups with DTensors are rebuilt on every step
    (the launch tables themselves are still reused when no address changed).
    """

    def __init__(self, optimizer, group, entries, launches, fast: bool):
        params = group["params"]
        self.params_list = params
        self.n_params = len(params)
        have = {id(p) for p, _ in entries}
        self.grad_mask = tuple(id(p) in have for p in params)
        active = [p for p, _ in entries]
        self.param_ptrs = tuple(map(_data_ptr, active)) if fast else None
        self.grad_ptrs = tuple(_data_ptr(g) for _, g in entries) if fast else None
        self.grad_dtypes = tuple(_get_dtype(g) for _, g in entries)
        self.flags = optimizer._plan_flags(group)
        self.state_obj = optimizer.state
        self.state_len = len(optimizer.state)
        keys = optimizer._checked_state_keys(group)
        self.state_dicts = [optimizer.state[p] for p in active] if keys else []
        self.state_checks = [(key, [st[key] for st in self.state_dicts]) for key in keys]
        self.launches = launches
        self.fast = fast

    def grads_if_valid(self, optimizer, group):
        """The group's gradients (active ones, in order) if the plan still holds, else None."""
        params = group["params"]
        if (not self.fast or params is not self.params_list or len(params) != self.n_params
                or optimizer.state is not self.state_obj or len(optimizer.state) != self.state_len
                or optimizer._plan_flags(group) != self.flags):
            return None
        try:
            all_grads = list(map(_get_grad, params))
            if tuple(map(operator.is_not, all_grads, repeat(None))) != self.grad_mask:
                return None
            grads = list(compress(all_grads, self.grad_mask))
            if tuple(map(_data_ptr, grads)) != self.grad_ptrs or tuple(map(_get_dtype, grads)) != self.grad_dtypes:
                return None
            if tuple(map(_data_ptr, compress(params, self.grad_mask))) != self.param_ptrs:
                return None
            for key, tensors in self.state_checks:
                if not all(map(operator.is_, map(operator.itemgetter(key), self.state_dicts), tensors)):
                    return None
        except (KeyError, RuntimeError, TypeError):  # a missing state entry, a sparse gradient...
            return None
        return grads

    def launch(self, optimizer, group, grads) -> None:
        for device, launcher, positions in self.launches:
            bucket_grads = grads if positions is None else [grads[i] for i in positions]
            optimizer._launch(launcher, bucket_grads, group, device)
