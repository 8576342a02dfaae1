"""Mixture-of-experts models in the step estimate: which layers route their tokens to experts, how many
parameters the experts hold and how many of them a token uses, and what expert parallelism moves.

A MoE layer replaces the dense MLP by ``experts`` routed MLPs of width ``expert_intermediate`` (each token goes
to ``top_k`` of them) and, in some families, shared experts that every token passes through. The families name
these differently in their HF configs; :func:`moe_shape` reads Mixtral, Qwen2/Qwen3-MoE, OLMoE and
DeepSeek-V2/V3 configs.

Expert parallelism (``ep``) spreads each MoE layer's experts over ``ep`` of the data-parallel (x context-parallel)
ranks: each keeps ``experts / ep`` of them, and every microbatch's routed tokens travel to the rank holding their
expert and back (an all-to-all "dispatch" and "combine" in the forward, the same two for the gradients in the
backward). Routing is never even: the estimate assumes the busiest expert-parallel rank receives
:data:`LOAD_IMBALANCE` times the mean tokens (what a router trained with a load-balancing loss reaches in
published runs, within a few tenths), and the step waits for that rank: its expert matmuls, their activations and
its all-to-all bytes are scaled by that factor.

Example::

    cfg = transformers.AutoConfig.for_model("qwen3_moe", num_experts=128, num_experts_per_tok=8, ...)
    moe = moe_shape(cfg, layers=48)           # MoEShape(experts=128, top_k=8, ...)
    moe.active_expert_params                   # what a token's matmuls use: expert_params x 8 / 128
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

__all__ = ["MoEShape", "LOAD_IMBALANCE", "moe_shape", "moe_layer_indices", "count_expert_params",
           "mean_mlp_width", "all_to_all_bytes"]

#: the tokens the busiest expert-parallel rank receives, as a multiple of the mean (an assumption, see above)
LOAD_IMBALANCE = 1.1


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The experts of a model: ``experts`` routed experts per MoE layer (``moe_layers`` of the model's layers),
    ``top_k`` of them per token, each a gated MLP of width ``expert_intermediate``; ``shared_intermediate`` is the
    width of the shared experts every token passes through (0: none); ``expert_params`` counts every routed
    expert's parameters in the model (the router and the shared experts are dense parameters)."""

    experts: int
    top_k: int
    expert_intermediate: int
    moe_layers: int
    expert_params: int
    shared_intermediate: int = 0

    @property
    def active_expert_params(self) -> float:
        """The routed experts' parameters one token's matmuls use."""
        return self.expert_params * self.top_k / self.experts


def _first(cfg: Any, *names: str):
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def moe_layer_indices(cfg: Any, layers: int) -> List[int]:
    """The layers (0-based) whose MLP is a mixture of experts, by the config's own rule: DeepSeek's
    ``first_k_dense_replace`` dense layers first (then every ``moe_layer_freq``-th), Qwen's ``mlp_only_layers``
    and ``decoder_sparse_step``; every layer for Mixtral and OLMoE."""
    if not _first(cfg, "num_local_experts", "num_experts", "n_routed_experts"):
        return []
    dense_first = getattr(cfg, "first_k_dense_replace", None) or 0
    every = getattr(cfg, "moe_layer_freq", None) or 1
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return [i for i in range(layers) if i >= dense_first and i % every == 0
            and (i + 1) % step == 0 and i not in dense]


def moe_shape(cfg: Any, layers: int, expert_params: Optional[int] = None) -> Optional[MoEShape]:
    """The experts of an HF config (None for a dense model). ``expert_params``: the routed experts' parameters as
    the built model counts them (:func:`count_expert_params`); else three ``hidden x expert_intermediate``
    matrices per expert and MoE layer."""
    experts = _first(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    if not experts:
        return None
    moe_layers = len(moe_layer_indices(cfg, layers))
    if not moe_layers:
        return None
    width = _first(cfg, "moe_intermediate_size", "intermediate_size")
    top_k = _first(cfg, "num_experts_per_tok", "moe_topk", "top_k") or 1
    shared = (getattr(cfg, "shared_expert_intermediate_size", None)
              or (getattr(cfg, "n_shared_experts", None) or 0) * width)
    if expert_params is None:
        expert_params = 3 * cfg.hidden_size * width * experts * moe_layers
    return MoEShape(experts=int(experts), top_k=int(top_k), expert_intermediate=int(width), moe_layers=moe_layers,
                    expert_params=int(expert_params), shared_intermediate=int(shared))


def count_expert_params(model: Any) -> int:
    """The routed experts' parameters of a built model (meta device is enough): every parameter under a module
    named ``experts`` (transformers keeps a layer's routed experts there as 3-D tensors; DeepSeek's
    ``shared_experts`` and Qwen's ``shared_expert`` are not routed)."""
    return sum(p.numel() for name, p in model.named_parameters() if "experts" in name.split(".")[:-1])


def mean_mlp_width(layers: int, intermediate: int, moe: Optional[MoEShape], imbalance: float = 1.0) -> float:
    """The MLP width one token passes through, averaged over the layers (a dense layer's ``intermediate``; a MoE
    layer's ``top_k`` routed experts, scaled by ``imbalance`` on the busiest rank, and its shared experts). A
    layer's activations and matmul flops grow linearly with it, so the mean gives the model's sum."""
    if moe is None:
        return float(intermediate)
    routed = moe.top_k * moe.expert_intermediate * imbalance + moe.shared_intermediate
    return ((layers - moe.moe_layers) * intermediate + moe.moe_layers * routed) / layers


def all_to_all_bytes(tokens: float, moe: MoEShape, hidden: int, dtype_bytes: int) -> float:
    """One all-to-all's payload per rank: each of ``tokens`` goes to ``top_k`` experts as a ``hidden`` vector."""
    return tokens * moe.top_k * hidden * dtype_bytes
