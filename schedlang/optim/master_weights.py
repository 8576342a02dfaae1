"""fp32 master weights for low-precision parameters: what the fused Adam keeps and checks.

A param group with ``master_weights=True`` trains its parameters in a compute dtype (bf16 or
fp16) while the optimizer keeps the fp32 value of each, the *master*, in its state under the key
``"master"``. Every step updates the master in fp32 and writes the parameter back as the master
rounded to nearest even. The model then computes with its own low-precision weights: no
fp32 -> bf16 cast of every weight in each forward, no bf16 -> fp32 cast of every weight gradient
in each backward, half the parameter and gradient memory. For one micro-batch per step the
numbers are those of autocast over fp32 weights: autocast's cast of a weight is the rounded
master, and its fp32 weight gradient is the upcast of the bf16 gradient computed here.

The optimizer **changes the dtype of the parameters** it is given: at construction the fp32
data of each parameter of such a group moves into the optimizer's state and the parameter
(the same ``nn.Parameter`` object, so modules and hooks keep working) gets its rounded copy.
Consequences, by design:

* the fp32 truth lives in the optimizer: read it with ``optimizer.masters()`` or
  ``optimizer.master_state_dict(model)``, and checkpoint the optimizer with the model;
* writing into a parameter afterwards (an initialization, ``model.load_state_dict``) changes the
  bf16 copy, not the master, and the next step overwrites it: load weights *before* building the
  optimizer, or load the optimizer's state dict after (which refreshes every parameter from its
  master);
* parameters that are views of a larger buffer stop being views (their data is replaced);
* gradients have the parameters' dtype: several micro-batches accumulated into ``.grad`` add up
  in bf16, where autocast over fp32 weights would add them in fp32. With one micro-batch per
  step the two give the same numbers.

Example::

    opt = FusedAdamW(model.parameters(), lr=3e-4, master_weights=True)  # model is now bf16
    model(x.bfloat16()).float().sum().backward()                        # bf16 gradients
    opt.step()                                                          # fp32 update, bf16 write-back
    torch.save(opt.master_state_dict(model), "fp32_weights.pt")
"""

from __future__ import annotations

import logging

from typing import Dict, List

import torch
from torch import nn

from schedlang.errors import ArgumentTypeError, ScheduleTypeError, ScheduleValueError

__all__ = ["COMPUTE_DTYPES", "check_master_group_params", "adopt_masters", "refresh_params_from_masters",
           "master_weight_groups"]

logger = logging.getLogger("schedlang.optim.master_weights")

#: dtypes a master-weights group may compute in
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def check_master_settings(group: dict, where: str) -> None:
    """Raise on a ``master_weights`` flag that is not a bool or a ``compute_dtype`` not in COMPUTE_DTYPES."""
    flag = group.get("master_weights", False)
    if not isinstance(flag, bool):
        raise ScheduleTypeError(f"master_weights: expected True or False, got {flag!r}{where}")
    dtype = group.get("compute_dtype", torch.bfloat16)
    if dtype not in COMPUTE_DTYPES:
        raise ScheduleValueError(f"compute_dtype: must be torch.bfloat16 or torch.float16 (the dtype the model "
                                 f"computes with; the masters are fp32), got {dtype!r}{where}")


def check_master_group_params(owner: str, params: list, group_index: int, compute_dtype: torch.dtype,
                              dtensor_class) -> None:
    """Raise unless every parameter of a master-weights group is a plain fp32 tensor."""
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            continue  # the generic check names it
        if dtensor_class and isinstance(p, dtensor_class):
            raise ScheduleTypeError(
                f"{owner}: param group {group_index} has master_weights=True, but parameter {i} (shape "
                f"{tuple(p.shape)}) is a DTensor; master weights support plain tensors only for now: put "
                "DTensor parameters in a group with master_weights=False")
        if p.dtype != torch.float32:
            raise ScheduleTypeError(
                f"{owner}: param group {group_index} has master_weights=True, but parameter {i} (shape "
                f"{tuple(p.shape)}) has dtype {p.dtype}: master weights need float32 parameters (the optimizer "
                f"keeps their fp32 value and turns them into {compute_dtype} copies); pass float32 parameters "
                "or use master_weights=False")


def _set_data(p: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``p`` new data of another dtype, keeping the object (and a gradient's dtype in step)."""
    p.data = value
    if p.grad is not None and p.grad.dtype != value.dtype:
        p.grad = p.grad.to(value.dtype)


@torch.no_grad()
def adopt_masters(params, state, compute_dtype: torch.dtype) -> None:
    """Move each fp32 parameter into ``state[p]["master"]`` and leave ``p`` its rounded copy."""
    for p in params:
        if "master" in state[p]:  # a parameter listed twice in its group
            continue
        master = p.detach().clone(memory_format=torch.preserve_format)
        state[p]["master"] = master
        _set_data(p, master.to(compute_dtype))


@torch.no_grad()
def refresh_params_from_masters(params, state) -> None:
    """Overwrite every parameter with its master, rounded to nearest even to the parameter's dtype."""
    for p in params:
        master = state[p].get("master")
        if master is not None:
            p.copy_(master)


def master_from_param(p: torch.Tensor, owner: str, why: str) -> torch.Tensor:
    """An fp32 master built from a parameter's current (low-precision) value, with a warning."""
    logger.warning("%s: %s; its fp32 master is rebuilt from the %s parameter of shape %s (the bits below "
                   "%s precision are lost)", owner, why, p.dtype, tuple(p.shape), p.dtype)
    return p.detach().to(torch.float32, memory_format=torch.preserve_format)


def master_weight_groups(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> List[Dict]:
    """Parameter groups for a fused Adam: the weights autocast would cast for a matmul with master weights, the
    rest as they are.

    The first group (``master_weights=True``) holds the plain fp32 weights of the model's ``nn.Linear``
    modules (and HF's ``Conv1D``, GPT-2's transposed Linear; torchao's ``Float8Linear``, so a float8
    model casts bf16 weights to float8; and the fused loss head of ``optimize_model``) that no other module
    also holds; the second every other trainable parameter. Embeddings, norms and biases stay fp32, so what
    they compute does not change (an fp32 embedding keeps the residual stream in fp32, as under autocast),
    and so does a weight shared with another module (a head tied to the embedding, which the embedding
    reads in fp32). Empty groups are left out.

    Example::

        opt = FusedAdamW(master_weight_groups(model), lr=1e-4, weight_decay=0.01)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"master_weight_groups: model must be a torch.nn.Module (the model whose parameters "
                                f"the groups hold), got {type(model).__name__}")
    holders: Dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    chosen: Dict[int, nn.Parameter] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (_is_matmul_module(module) and isinstance(weight, nn.Parameter) and type(weight.data) is torch.Tensor
                and weight.requires_grad and weight.dtype == torch.float32 and holders.get(id(weight)) == 1):
            chosen[id(weight)] = weight
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    groups: List[Dict] = []
    if chosen:
        groups.append({"params": list(chosen.values()), "master_weights": True, "compute_dtype": compute_dtype})
    if rest:
        groups.append({"params": rest})
    return groups


def _is_matmul_module(module: nn.Module) -> bool:
    """A plain ``nn.Linear``; transformers' ``Conv1D`` (GPT-2's Linear with a transposed weight, one
    ``addmm``); or torchao's ``Float8Linear`` (float8 training): the modules whose weight is cast for a
    matmul every step. A float8 Linear scales and casts a bf16 weight as it does an fp32 one, reading half
    the bytes, and its weight gradient comes out in bf16 without the cast to fp32. A class that declares
    ``weight_is_matmul_operand = True`` is one too: schedlang's fused linear + cross-entropy head, whose
    loss kernel reads the weight cast to the compute dtype. Other subclasses (sharded Linears) keep their
    own handling of the weight."""
    cls = type(module)
    if cls is nn.Linear or getattr(cls, "weight_is_matmul_operand", False) is True:
        return True
    if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers."):
        return True
    return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")
