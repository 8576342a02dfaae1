"""Fused multi-tensor Adam and AdamW (drop-in for ``torch.optim.Adam`` / ``torch.optim.AdamW``).

With ``master_weights=True`` the optimizer keeps an fp32 master of each parameter and **turns
the parameters themselves into bf16 (or fp16) copies**, see :mod:`schedlang.optim.master_weights`.

Example::

    from schedlang.optim import FusedAdamW
    opt = FusedAdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    loss.backward(); opt.step(); sched.step()
"""

from __future__ import annotations

import logging
import torch

from schedlang.errors import ScheduleTypeError, ScheduleValueError
from schedlang.optim import master_weights as mw
from schedlang.optim.base import FusedOptimizer, _dtensor_class, fp32_state_like, local_tensor

logger = logging.getLogger("schedlang.optim.adam")

__all__ = ["FusedAdam", "FusedAdamW"]


def _as_float(x):
    return float(x) if isinstance(x, torch.Tensor) else x


class FusedAdam(FusedOptimizer):
    """Adam whose step is one multi-tensor Triton launch per (param group, device, dtype).

    Arguments are those of ``torch.optim.Adam``. ``foreach``, ``fused`` and ``capturable`` are
    accepted and stored (the kernel is always fused and capturable); ``differentiable=True`` is
    refused. Parameters may be fp32, bf16 or fp16; the state (``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``) is fp32 and ``step`` a 0-d fp32 tensor on the parameter's device, under
    torch.optim's key names, so state dicts load both ways. ``lr`` may be a float or a 1-element
    tensor; a tensor on the parameters' device is read by the kernel, so changing it in place
    (an LR scheduler does) needs no recompilation, no host synchronization, and works between
    replays of a captured CUDA graph.

    **Master weights** (``master_weights=True``, for all groups or per group, with
    ``compute_dtype`` torch.bfloat16 (default) or torch.float16): the group's parameters must be
    fp32 and plain tensors; **the constructor changes their dtype to** ``compute_dtype``. Their
    fp32 values move into the state as ``state[p]["master"]``; each step updates the masters in
    fp32 from the low-precision gradients and stores every parameter as its master rounded to
    nearest even, in the same single launch. The model then runs on its bf16 weights without
    casting them in every forward and backward, with autocast-over-fp32 numerics. Read the fp32
    values with :meth:`masters` or :meth:`master_state_dict`; ``state_dict()`` saves the masters,
    and ``load_state_dict`` refreshes each parameter from its loaded master (a resumed run
    continues bit for bit). Load model weights *before* building the optimizer: a later write into
    a parameter changes only its bf16 copy. See :mod:`schedlang.optim.master_weights`.

    Example::

        opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=1e-4, amsgrad=True)
        model(x).sum().backward()
        opt.step()

        # Linear weights in bf16 with fp32 masters, norms and biases stay fp32
        opt = FusedAdamW([{"params": linear_weights, "master_weights": True},
                          {"params": other_params}], lr=3e-4)
    """

    _torch_name = "Adam"
    _state_tensor_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
    _always_decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, master_weights=False, compute_dtype=torch.bfloat16):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay or self._always_decoupled,
                        master_weights=master_weights, compute_dtype=compute_dtype)
        self._check_hyperparameters(defaults, "")
        defaults["betas"] = tuple(_as_float(b) for b in betas)
        # parameters change dtype only once every group is accepted: a bad group leaves the model as it was
        self._constructing = True
        super().__init__(params, defaults)
        self._constructing = False
        if any(group["master_weights"] for group in self.param_groups):
            for group in self.param_groups:
                if group["master_weights"]:
                    mw.adopt_masters(group["params"], self.state, group["compute_dtype"])
            self._init_missing_state()

    def _init_missing_state(self) -> None:
        """Create now, for every parameter, the state its first step would create (step 0, zero moments).

        With master weights the state is not empty from the start, and
        ``torch.distributed.checkpoint`` takes a non-empty state for a complete one: it loads only
        the keys it finds. A complete state makes a checkpoint load every moment and step count."""
        for group in self.param_groups:
            states_of = self._states_of(group)
            for p in group["params"]:
                states_of(p, self.state)

    def _check_group(self, group: dict, where: str) -> None:
        eps, betas = group["eps"], group["betas"]
        if not 0.0 <= eps:
            raise ScheduleValueError(f"Invalid epsilon value: {eps}{where}: must be >= 0")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ScheduleTypeError(f"Invalid betas: {betas!r}{where}: expected a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            if isinstance(beta, torch.Tensor) and beta.numel() != 1:
                raise ScheduleValueError(f"Tensor betas[{i}] must be 1-element{where}")
            if not 0.0 <= beta < 1.0:
                raise ScheduleValueError(
                    f"Invalid beta parameter at index {i}: {_as_float(beta)}{where}: must be in [0, 1)")
        mw.check_master_settings(group, where)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; with master weights, its fp32 parameters become compute-dtype copies."""
        settings = {**self.defaults, **param_group}
        params = param_group["params"]
        if settings.get("master_weights") and not isinstance(params, set):
            mw.check_master_settings(settings, f" (param group {len(self.param_groups)})")
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            mw.check_master_group_params(type(self).__name__, [p[1] if isinstance(p, tuple) else p for p in params],
                                         len(self.param_groups), settings["compute_dtype"], _dtensor_class())
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["master_weights"] and not self.__dict__.get("_constructing", False):
            mw.adopt_masters(group["params"], self.state, group["compute_dtype"])
            self._init_missing_state()

    def masters(self) -> dict:
        """``{parameter: its fp32 master}`` over the master-weights groups (the optimizer's own
        tensors, updated in place by every step: clone them to keep a snapshot).

        Example::

            fp32_weight = opt.masters()[model.proj.weight]
        """
        return {p: self.state[p]["master"] for group in self.param_groups if group["master_weights"]
                for p in group["params"] if "master" in self.state.get(p, {})}

    def master_state_dict(self, model: torch.nn.Module) -> dict:
        """``model.state_dict()`` with every parameter that has a master replaced by the fp32
        master: the full-precision weights, for export or a model-only checkpoint.

        Example::

            torch.save(opt.master_state_dict(model), "model_fp32.pt")
        """
        masters = self.masters()
        state = model.state_dict()
        for name, p in model.named_parameters(remove_duplicate=False):
            if p in masters and name in state:
                state[name] = masters[p].detach()
        return state

    def _plan_flags(self, group: dict) -> tuple:
        return (bool(group["amsgrad"]), bool(group["master_weights"]))

    def _checked_state_keys(self, group: dict) -> tuple:
        keys = ("exp_avg", "exp_avg_sq", "step")
        keys = keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys
        return keys + ("master",) if group["master_weights"] else keys

    def _states_of(self, group: dict):
        amsgrad, master_weights = group["amsgrad"], group["master_weights"]
        owner = type(self).__name__

        def states_of(p, states):
            state = states[p]
            if "step" not in state:  # lazy initialization, on the first step with a gradient
                state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
                state["exp_avg"] = fp32_state_like(p)
                state["exp_avg_sq"] = fp32_state_like(p)
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = fp32_state_like(p)
            if master_weights and "master" not in state:  # the state was cleared by hand
                state["master"] = mw.master_from_param(p, owner, "a parameter's state has no master")
            return (state["exp_avg"], state["exp_avg_sq"], state["max_exp_avg_sq"] if amsgrad else None,
                    state["step"], state["master"] if master_weights else None)

        return states_of

    def _make_launcher(self, lists, tables):
        from schedlang.kernels.multi_tensor_adam import AdamLauncher

        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, masters = lists
        amsgrad = max_exp_avg_sqs[0] is not None
        return AdamLauncher(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps,
                            amsgrad=amsgrad, masters=masters if masters[0] is not None else None, tables=tables)

    # -- master weights in state dicts ----------------------------------------------------

    def _check_state_dict_to_load(self, state_dict: dict) -> None:
        """Saved masters must go to master-weights groups, shaped like their parameters; then the
        shapes of the other states (:meth:`FusedOptimizer._check_state_dict_to_load`)."""
        owner = type(self).__name__
        saved_state = state_dict.get("state", {})
        for gi, (saved, group) in enumerate(zip(state_dict.get("param_groups", ()), self.param_groups)):
            for i, (key, p) in enumerate(zip(saved.get("params", ()), group["params"])):
                master = saved_state.get(key, {}).get("master")
                if not isinstance(master, torch.Tensor):
                    continue
                if not group["master_weights"]:
                    raise ScheduleValueError(
                        f"{owner}.load_state_dict: the state dict holds an fp32 master for parameter {i} of "
                        f"param group {gi}, but that group has master_weights=False; use master_weights=True "
                        "for this group to resume from it")
                if master.shape != p.shape:
                    raise ScheduleValueError(
                        f"{owner}.load_state_dict: the master of parameter {i} of param group {gi} has shape "
                        f"{tuple(master.shape)}, the parameter {tuple(p.shape)}; a master must match its "
                        "parameter's shape (was the state dict saved for another model?)")
        super()._check_state_dict_to_load(state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of the matching ``torch.optim`` class.

        ``master_weights`` and ``compute_dtype`` stay those this optimizer was built with (they
        describe its parameters' dtypes). Each parameter of a master-weights group is then
        overwritten by its loaded master, rounded. A state dict without masters (torch.optim's,
        or one saved without master weights) keeps the masters this optimizer already holds, the
        fp32 values its parameters had at construction or after its last step, and logs a warning.

        Example::

            opt.load_state_dict(torch.load("optim.pt"))   # the bf16 parameters now match the masters
        """
        settings = [(g["master_weights"], g["compute_dtype"]) for g in self.param_groups]
        previous = self.masters()
        super().load_state_dict(state_dict)
        kept = 0
        for group, (flag, dtype) in zip(self.param_groups, settings):
            group["master_weights"], group["compute_dtype"] = flag, dtype
            if not flag:
                continue
            for p in group["params"]:
                state = self.state[p]
                if "master" not in state:
                    if p in previous:
                        state["master"] = previous[p]
                        kept += 1
                    else:
                        state["master"] = mw.master_from_param(p, type(self).__name__,
                                                               "neither the state dict nor the optimizer has a master")
            mw.refresh_params_from_masters(group["params"], self.state)
        if kept:
            logger.warning("%s.load_state_dict: the state dict has no fp32 masters for %d parameters of "
                           "master-weights groups; kept the optimizer's current masters for them", type(self).__name__,
                           kept)

    def _launch(self, launcher, grads, group: dict, device: torch.device) -> None:
        beta1, beta2 = group["betas"]
        launcher(grads, lr=self._lr_argument(group["lr"], device), beta1=_as_float(beta1), beta2=_as_float(beta2),
                 eps=_as_float(group["eps"]), weight_decay=_as_float(group["weight_decay"]),
                 maximize=group["maximize"],
                 decoupled_weight_decay=self._always_decoupled or bool(group.get("decoupled_weight_decay", False)))


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay) as one multi-tensor Triton launch per bucket.

    Arguments are those of ``torch.optim.AdamW`` (``weight_decay`` defaults to 1e-2), plus
    ``master_weights`` and ``compute_dtype``; see :class:`FusedAdam` for dtypes, state layout,
    the learning-rate tensor and master weights (which **change the parameters' dtype**).

    Example::

        opt = FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            opt.step()          # after a few eager steps, so that the state exists
        opt.param_groups[0]["lr"].fill_(5e-4); g.replay()
    """

    _torch_name = "AdamW"
    _always_decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 master_weights=False, compute_dtype=torch.bfloat16):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
                         master_weights=master_weights, compute_dtype=compute_dtype)
