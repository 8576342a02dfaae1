"""Expert parallelism: each rank of a group holds a contiguous slice of a mixture-of-experts block's experts.

transformers 5.x keeps a block's experts as 3-D tensors in one module (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I], see :mod:`schedlang.distributed.shard_rules.experts`) whose forward receives the
tokens, the router's top-k expert indices and its top-k weights. Under expert parallelism over a group of
``ep`` ranks, rank r keeps experts ``[r*E/ep, (r+1)*E/ep)`` and its experts module is replaced by
:class:`ExpertParallelExperts`, whose forward

1. lists every (token, choice) pair and sorts the pairs by expert (stably, so a token's choices keep
   their order), which also orders them by the rank holding the expert;
2. exchanges the number of pairs per expert with every rank (an all-to-all of counts), so each rank knows
   how many rows it will receive from each rank for each of its experts;
3. sends the tokens' hidden states to the ranks holding their experts (:func:`all_to_all`: an all-to-all
   with variable splits, its backward the same exchange the other way);
4. regroups the received rows by local expert and runs the local experts unweighted: where the family's
   experts are in transformers' standard layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
   ``act_fn(gate) * up``, no biases: Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3) with two grouped matrix
   products (:func:`schedlang.kernels.grouped_gemm_experts.grouped_experts_forward`: one Triton or
   ``torch._grouped_mm`` launch for all local experts on a GPU, the family's per-expert ``F.linear`` on CPU);
   otherwise (GPT-OSS's biases and clamped activation, a custom experts class) with the family's own expert
   forward, every routing weight set to 1, so that the expert computation is exactly the family's;
5. sends the results back, multiplies each by its routing weight on the rank the token came from, and
   sums a token's choices.

Nothing is dropped (no capacity limit). The router, its top-k and normalisation, and a shared expert
stay as the family wrote them and run on each rank's own tokens.

Gradient contract (expert parallelism carved from data-parallel ranks, each rank its own tokens): the
gradient of a local expert's weights, after backward, is the gradient of the *sum* of the group's losses
(every rank's tokens that chose the expert sent their gradient back to it); every other parameter (the
router, a shared expert, attention) holds the gradient of this rank's loss only and needs the ordinary
data-parallel reduction. So: sum the non-expert gradients over the data-parallel ranks as usual, never
reduce expert gradients over the expert-parallel group (its ranks hold different experts), sum them over
the ranks holding the *same* experts (data-parallel ranks outside the group, if any), and scale both
alike (divide by the data-parallel size for a mean). :func:`expert_parameters` tells them apart.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import groups

__all__ = ["all_to_all", "exchange_counts", "route_to_experts", "ExpertParallelExperts", "expert_parameters",
           "reduce_gradients", "attach_expert_mesh", "expert_mesh_of", "expert_modules"]

logger = logging.getLogger("schedlang.distributed.expert_parallel")

def expert_parameters(model: nn.Module) -> Dict[str, Tuple[int, int, Tuple[int, ...]]]:
    """Name -> ``(ep_size, ep_rank, full_shape)`` of every parameter of ``model`` that is a rank's slice of
    expert weights (see the module docstring for how their gradients differ from the others'). Read from
    the expert-parallel modules, so it holds for copies of the model too."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            for name, full_shape in module.expert_weight_shapes.items():
                found[f"{path}.{name}" if path else name] = (module.ep_size, module.ep_rank, full_shape)
    return found


class _AllToAll(torch.autograd.Function):
    """All-to-all with variable splits along dim 0; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), list(in_splits), list(out_splits), group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    """Rows ``x`` split by ``in_splits`` go to the group's ranks in order; returns the rows received, by source
    rank (``out_splits`` of them from each). Differentiable. A group of one rank returns ``x``."""
    if groups.world_size(group) == 1:
        return x
    return _AllToAll.apply(x, tuple(int(s) for s in out_splits), tuple(int(s) for s in in_splits), group)


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """``send_counts`` [ep, L]: rows this rank sends to each rank's L local experts; returns [ep, L], the rows
    each rank sends to this rank's experts."""
    if groups.world_size(group) == 1:
        return send_counts
    received = torch.empty_like(send_counts)
    dist.all_to_all_single(received, send_counts.contiguous(), group=group)
    return received


def route_to_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     num_experts: int, local_experts, group, on_counts=None) -> torch.Tensor:
    """The weighted sum, per token, of its top-k experts' outputs, the experts spread over ``group``.

    ``hidden`` [T, H]; ``top_k_index`` [T, k] global expert ids (an id outside [0, num_experts) is a choice
    left out, as transformers' padding value ``num_experts``); ``top_k_weights`` [T, k].
    ``local_experts(rows, local_ids)`` runs this rank's experts (``num_experts / ep`` of them, ids local)
    on rows sorted by local id and returns their outputs, unweighted, in the same order.
    ``on_counts``, if given, is called with the number of rows each local expert received from the whole
    group in this call (a tensor of ``num_experts / ep`` integers, outside autograd).
    """
    ep = groups.world_size(group)
    local = num_experts // ep
    tokens, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    weight = top_k_weights.reshape(-1)
    token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    kept = (expert >= 0) & (expert < num_experts)
    if not bool(kept.all()):
        expert, weight, token = expert[kept], weight[kept], token[kept]
    with torch.no_grad():
        order = torch.argsort(expert, stable=True)
        per_expert = torch.bincount(expert, minlength=num_experts)
    token_sorted = token[order]
    if ep == 1:
        # every expert is here: the rows sorted by expert are already what the experts take, with no exchange,
        # no split sizes read back to the host and no regrouping by source rank
        if on_counts is not None:
            on_counts(per_expert)
        computed = local_experts(hidden.index_select(0, token_sorted), expert[order])
        weighted = computed * weight[order].unsqueeze(-1).to(computed.dtype)
        return torch.zeros_like(hidden).index_add(0, token_sorted, weighted.to(hidden.dtype))
    with torch.no_grad():
        send_counts = per_expert.view(ep, local)
        recv_counts = exchange_counts(send_counts, group)
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        # received rows come by source rank, each source's rows by local expert: regroup them by expert
        local_ids = torch.arange(local, device=hidden.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        by_expert = torch.argsort(local_ids, stable=True)
        back_order = torch.argsort(by_expert)
        if on_counts is not None:
            on_counts(recv_counts.sum(0))
    received = all_to_all(hidden.index_select(0, token_sorted), out_splits, in_splits, group)
    computed = local_experts(received.index_select(0, by_expert), local_ids[by_expert])
    # the backward of the all-to-all that brought the rows is a collective: it must run on every rank, also
    # where the local experts' output does not depend on the rows (none received); adding the sum of no rows
    # (0) ties it to the output whatever ``local_experts`` does
    computed = computed + received[:0].sum()
    returned = all_to_all(computed.index_select(0, back_order), in_splits, out_splits, group)
    weighted = returned * weight[order].unsqueeze(-1).to(returned.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add(0, token_sorted, weighted.to(out.dtype))


class _GroupHandle:
    """The expert-parallel process group as a module attribute: a copy of the model (``copy.deepcopy``, as
    ``Verify`` and ``build`` make) shares the group, which cannot be copied."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self


#: where a module kept whole under sequence parallelism holds the group over which its weights' gradients are
#: summed (``schedlang.models._common.gradient_summed``: each tp rank runs its own sequence slice through it)
_SUMMED_OVER_TP = "_schedlang_tensor_parallel_grad_group"


class ExpertParallelExperts(nn.Module):
    """A block's experts module under expert parallelism: holds this rank's slice of the expert weights
    (the family's tensor names, the experts along dim 0) and routes tokens over ``ep_group``.

    Made by :meth:`from_experts` from the family's module, whose attributes (config, activation, layout
    flags) it keeps; the family's class is kept as ``family_class`` and its forward computes the local
    experts. ``num_experts`` stays the block's total.

    Beside tensor and sequence parallelism the experts module arrives kept whole, its weights' gradients summed
    over the tp ranks (each runs its own sequence slice through it); the spread module keeps that sum
    (``tp_group``): the expert-parallel group then holds the ranks of one tp rank, and a slice's gradient is
    the sum over the tokens of every rank of the group and every tp rank.
    """

    @classmethod
    def from_experts(cls, experts: nn.Module, group, weight_names: List[str]) -> "ExpertParallelExperts":
        from ..module_record import copy_module_as

        ep, rank = groups.world_size(group), groups.rank(group)
        total = int(experts._parameters[weight_names[0]].shape[0])
        new = copy_module_as(experts, cls, remember_class=True)
        family = type(experts)
        summed = new.__dict__.pop(_SUMMED_OVER_TP, None)
        if summed is not None:  # the family's class under the wrapper; the spread module sums the gradients itself
            family = family.__mro__[1]
        local = total // ep
        for name in weight_names:
            full = experts._parameters[name]
            new._parameters[name] = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone(),
                                                 requires_grad=full.requires_grad)
        new.__dict__["expert_weight_shapes"] = {name: tuple(experts._parameters[name].shape) for name in weight_names}
        new.__dict__["family_class"] = family
        new.__dict__["_ep_group"] = _GroupHandle(group)
        new.__dict__["_tp_group"] = _GroupHandle(summed.group if summed is not None else None)
        new.__dict__["sums_over_tp"] = summed is not None
        new.__dict__["ep_size"] = ep
        new.__dict__["ep_rank"] = rank
        new.__dict__["total_experts"] = total
        new.__dict__["local_experts"] = local
        new.__dict__["tokens_per_expert"] = None
        return new

    @property
    def ep_group(self):
        """The expert-parallel process group (None: the world)."""
        return self._ep_group.group

    @property
    def tp_group(self):
        """The tp ranks over which the weights' gradients are summed (only where ``sums_over_tp``)."""
        return self._tp_group.group

    def _family_view(self) -> nn.Module:
        # the family's forward, run on an object of its class that shares this module's tables, sees
        # only the local experts
        view = object.__new__(self.family_class)
        view.__dict__.update(self.__dict__)
        if "num_experts" in view.__dict__:
            view.__dict__["num_experts"] = self.local_experts
        return view

    #: run the local experts with grouped matrix products where the family's experts are in the standard layout
    #: (see the module docstring); False on an instance keeps the family's own expert loop
    grouped_gemm = True

    def grouped_layout(self) -> bool:
        """Whether :meth:`run_local` may use the grouped products: the family's experts are in transformers'
        standard layout and the kernels import (decided once per module)."""
        known = self.__dict__.get("_grouped_layout")
        if known is None:
            try:
                from ..kernels.grouped_gemm_experts import standard_layout_mismatch
            except ImportError as e:  # no Triton: the family's loop
                reason = f"the grouped-product kernels do not import ({e})"
            else:
                reason = standard_layout_mismatch(self, self.family_class)
            if reason is not None:
                logger.debug("expert parallelism keeps %s's own expert loop: %s", self.family_class.__name__, reason)
            known = self.__dict__["_grouped_layout"] = reason is None
        return known

    def _use_grouped(self, rows: torch.Tensor) -> bool:
        # F.linear under autocast casts the rows to the weights' dtype, which grouped_mm would refuse: autocast
        # and mixed dtypes keep the family's loop, as do weights that are tensor subclasses (a DTensor outside
        # FSDP's unsharded forward), whose per-expert slices the family's loop already handles
        if not self.grouped_gemm or not self.grouped_layout():
            return False
        weights = (self.gate_up_proj, self.down_proj)
        return (all(type(w) in (torch.Tensor, nn.Parameter) and w.dtype == rows.dtype for w in weights)
                and not torch.is_autocast_enabled(rows.device.type))

    def run_local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``rows`` (``local_ids`` the local expert of each, sorted), unweighted."""
        if rows.shape[0] == 0:
            # no token for any local expert: the output must still depend on the received rows, so that the
            # backward of the all-to-all that brought them runs here as on every other rank (it is a
            # collective), and on the weights, so that their gradient is zero rather than missing
            anchor = sum(p.reshape(-1)[:1].sum() for p in self._parameters.values() if p is not None)
            return rows * 0 + 0 * anchor.to(rows.dtype)
        if self._use_grouped(rows):
            from ..kernels.grouped_gemm_experts import grouped_experts_forward

            counts = torch.bincount(local_ids, minlength=self.local_experts)
            return grouped_experts_forward(self, rows, counts)
        view = self._family_view()
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return self.family_class.forward(view, rows, local_ids.unsqueeze(-1), ones)

    def _record_counts(self, counts: torch.Tensor) -> None:
        # a plain attribute, not a buffer: it is a reading of the last forward, not state to save or copy
        if self.sums_over_tp and groups.world_size(self.tp_group) > 1:
            # each tp rank routed its own sequence slice: an expert's rows are those of every tp rank
            counts = counts.clone()
            dist.all_reduce(counts, group=self.tp_group)
        self.__dict__["tokens_per_expert"] = counts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The block's expert output for its tokens; afterwards ``tokens_per_expert`` holds the rows each
        local expert received from the whole group in this call (``local_experts`` integers; beside sequence
        parallelism, summed over the tp ranks, each of which routed its own sequence slice)."""
        if not self.sums_over_tp:
            return route_to_experts(hidden_states, top_k_index, top_k_weights, self.total_experts, self.run_local,
                                    self.ep_group, on_counts=self._record_counts)
        from .collectives import reduce_backward

        # the weights are read through an identity whose backward sums their gradients over the tp ranks, for the
        # duration of this call (FSDP2's unsharded weights, if any, are those in place now)
        own = self.__dict__["_parameters"]
        self.__dict__["_parameters"] = {n: (reduce_backward(p, self.tp_group) if p is not None and p.requires_grad
                                            else p) for n, p in own.items()}
        try:
            return route_to_experts(hidden_states, top_k_index, top_k_weights, self.total_experts, self.run_local,
                                    self.ep_group, on_counts=self._record_counts)
        finally:
            self.__dict__["_parameters"] = own

    def extra_repr(self) -> str:
        return (f"{self.family_class.__name__}, experts {self.ep_rank * self.local_experts}.."
                f"{(self.ep_rank + 1) * self.local_experts - 1} of {self.total_experts} on rank {self.ep_rank} "
                f"of {self.ep_size}")


def reduce_gradients(model: nn.Module, dp_group=None, replica_group=None, average: bool = True) -> None:
    """The data-parallel gradient reduction of a model with expert-parallel blocks, in place.

    Every gradient that is not an expert slice's is summed over ``dp_group`` (None: the world). An expert
    slice's gradient already holds the sum over its expert-parallel group's losses: it is summed over
    ``replica_group`` only, the ranks holding the same experts in the other expert-parallel groups (None
    where the expert-parallel group is the whole data-parallel group). With ``average`` every gradient is
    then divided by the data-parallel size, the gradient of the mean of the ranks' losses.
    """
    dp = groups.world_size(dp_group)
    spread = expert_parameters(model)
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        group = replica_group if name in spread else dp_group
        if name not in spread or replica_group is not None:
            if groups.world_size(group) > 1:
                dist.all_reduce(param.grad, group=group)
        if average and dp > 1:
            param.grad.div_(dp)


# ------------------------------------------------------------------------------------------------ expert meshes
def attach_expert_mesh(module: ExpertParallelExperts, mesh2d) -> None:
    """Give a spread experts module its expert mesh ``("ep", "ep_replicate")``
    (:mod:`schedlang.distributed.expert_mesh`): ``build`` runs the experts' data parallelism on its
    ``ep_replicate`` ranks, checkpoints address its rows of the full weights through it. Copies share it."""
    module.__dict__["_ep_mesh"] = _GroupHandle(mesh2d)


def expert_mesh_of(module: nn.Module):
    """The expert mesh of a spread experts module (None: spread over a group without one)."""
    handle = module.__dict__.get("_ep_mesh")
    return handle.group if handle is not None else None


def expert_modules(model: nn.Module) -> Dict[str, ExpertParallelExperts]:
    """Path -> spread experts module, of every expert-parallel block of ``model``."""
    return {path: m for path, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
