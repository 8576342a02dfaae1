"""Drop-in modules and functions over the training-step kernels, for schedules to swap HF parts with.

* :class:`FusedRMSNorm`: LlamaRMSNorm's parameter (``weight``) and attribute (``variance_epsilon``),
  its forward, and an optional ``residual`` argument for the fused residual add;
* :class:`FusedSwiGLUMLP`: LlamaMLP's children (``gate_proj``, ``up_proj``, ``down_proj``) with
  ``silu(gate) * up`` in one kernel;
* :class:`FusedEmbedding`: ``nn.Embedding``'s parameter (``weight``) and attributes (``num_embeddings``,
  ``embedding_dim``, ``padding_idx``), its lookup, and the weight's gradient from deterministic kernels;
* :func:`fused_apply_rotary_pos_emb`: HF's ``apply_rotary_pos_emb`` signature;
* :func:`fused_causal_lm_loss`: HF's causal-LM loss (labels shifted inside, ``-100`` ignored, mean over
  the counted tokens) straight from the last hidden states, without the logits.

``from_module`` builds each module around the original's parameters (the same ``Parameter``
objects: nothing is copied, optimizers and checkpoints see the same names)::

    sch["model.norm"].replace(FusedRMSNorm.from_module(sch["model.norm"].mod))
    sch.replace_all(LlamaMLP, lambda path, old: FusedSwiGLUMLP.from_module(old))
    sch.replace_all(nn.Embedding, fused_embedding_like)   # from_module in replace_all's (path, old) form
    loss = fused_causal_lm_loss(model.model(ids).last_hidden_state, model.lm_head, labels)
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from schedlang.argument_checks import FLOATING_DTYPES, check_int, check_integer_tensor, check_number, check_tensor
from schedlang.errors import ScheduleTypeError, ScheduleValueError
from schedlang.kernels.embedding import embedding, normalized_padding_idx
from schedlang.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from schedlang.kernels.rms_norm import check_compiled_form, rms_norm
from schedlang.kernels.rotary import apply_rotary
from schedlang.kernels.swiglu import swiglu

__all__ = ["FusedRMSNorm", "FusedSwiGLUMLP", "FusedEmbedding", "fused_embedding_like", "fused_apply_rotary_pos_emb",
           "fused_causal_lm_loss"]


class FusedRMSNorm(nn.Module):
    """RMSNorm as HF's ``LlamaRMSNorm`` computes it, in one Triton kernel each way.

    ``forward(hidden_states)`` returns the normalized states; ``forward(hidden_states, residual)``
    adds first and returns ``(normalized, residual + hidden_states)``, the sum being the next
    residual (one read of each input instead of an add kernel and a norm kernel). ``compiled``
    says what a ``torch.compile`` graph of the module runs: ``"inductor"`` (default: Inductor's code for
    the PyTorch reference) or ``"kernel"`` (the same kernels, as custom operators; see :func:`rms_norm`).

    Example::

        norm = FusedRMSNorm(2048, eps=1e-5)
        y, residual = norm(attn_out, residual)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, compiled: str = "inductor") -> None:
        # checked here rather than at the first forward, which would name rms_norm and not this constructor
        check_int("FusedRMSNorm", "hidden_size", hidden_size, minimum=1)
        check_number("FusedRMSNorm", "eps", eps, minimum=0)
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.compiled = check_compiled_form(compiled, "FusedRMSNorm")

    @classmethod
    def from_module(cls, module: nn.Module, compiled: str = "inductor") -> "FusedRMSNorm":
        """A FusedRMSNorm sharing ``module``'s weight (any RMSNorm with ``weight`` and ``variance_epsilon``
        or ``eps``, e.g. HF LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm)."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
            raise ScheduleTypeError(
                f"FusedRMSNorm.from_module: {type(module).__name__} is not an RMSNorm: expected a 1-D parameter "
                f"'weight' and an attribute 'variance_epsilon' or 'eps'")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = weight
        new.variance_epsilon = float(eps)
        new.compiled = check_compiled_form(compiled, "FusedRMSNorm")
        return new

    def forward(self, hidden_states: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual, compiled=self.compiled)

    def extra_repr(self) -> str:
        compiled = "" if self.compiled == "inductor" else f", compiled={self.compiled!r}"
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{compiled}"



class FusedSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the SwiGLU in one kernel (HF LlamaMLP).

    Example::

        mlp = FusedSwiGLUMLP.from_module(model.model.layers[0].mlp)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None,
                 dtype=None) -> None:
        check_int("FusedSwiGLUMLP", "hidden_size", hidden_size, minimum=1)
        check_int("FusedSwiGLUMLP", "intermediate_size", intermediate_size, minimum=1)
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_module(cls, module: nn.Module) -> "FusedSwiGLUMLP":
        """A FusedSwiGLUMLP over ``module``'s own ``gate_proj``, ``up_proj`` and ``down_proj`` (shared, not
        copied); ``module.act_fn`` must be SiLU."""
        missing = [n for n in ("gate_proj", "up_proj", "down_proj") if not isinstance(getattr(module, n, None),
                                                                                      nn.Module)]
        if missing:
            raise ScheduleTypeError(f"FusedSwiGLUMLP.from_module: {type(module).__name__} has no "
                                    f"{', '.join(missing)}: expected an MLP with gate_proj, up_proj and down_proj")
        act = getattr(module, "act_fn", None)
        # transformers 5 has its own SiLUActivation class; older versions use nn.SiLU
        if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            raise ScheduleValueError(f"FusedSwiGLUMLP.from_module: {type(module).__name__}.act_fn is "
                                     f"{type(act).__name__}: only SiLU (hidden_act='silu') is fused")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = module.gate_proj, module.up_proj, module.down_proj
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class FusedEmbedding(nn.Embedding):
    """A token embedding as ``nn.Embedding`` computes it (the same lookup, the same ``padding_idx``
    rule), whose weight gradient comes from deterministic Triton kernels (see
    :func:`~schedlang.kernels.embedding.embedding`).

    It is an ``nn.Embedding`` (the same attributes and initialization), so what treats one as such keeps
    working: transformers' ``_init_weights`` initializes it when a model is built on the meta device,
    ``get_input_embeddings`` and weight tying find it. Only ``nn.Embedding``'s default options are
    implemented: ``max_norm`` (renormalizing looked-up rows in place), ``scale_grad_by_freq`` and
    ``sparse`` gradients are not; the constructor and :meth:`from_module` refuse them.

    Example::

        embed = FusedEmbedding.from_module(model.model.embed_tokens)   # shares its weight
        sch.replace_all(nn.Embedding, fused_embedding_like)            # every nn.Embedding of a schedule
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None, device=None,
                 dtype=None) -> None:
        check_int("FusedEmbedding", "num_embeddings", num_embeddings, minimum=1)
        check_int("FusedEmbedding", "embedding_dim", embedding_dim, minimum=1)
        padding_idx = normalized_padding_idx("FusedEmbedding", padding_idx, num_embeddings)
        # nn.Embedding's initialization: N(0, 1), the padding row zero
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)

    @classmethod
    def from_module(cls, module: nn.Module) -> "FusedEmbedding":
        """A FusedEmbedding sharing ``module``'s weight (the same ``Parameter``, not a copy) and keeping
        its ``num_embeddings``, ``embedding_dim`` and ``padding_idx``; ``module`` is a plain
        ``nn.Embedding`` with the default ``max_norm``, ``scale_grad_by_freq`` and ``sparse``."""
        if not isinstance(module, nn.Embedding):
            raise ScheduleTypeError(f"FusedEmbedding.from_module: {type(module).__name__} is not an nn.Embedding: "
                                    f"expected an nn.Embedding (a 2-D 'weight' looked up by row)")
        # a subclass that computes something else (HF's scaled word embeddings multiply by sqrt(hidden))
        if type(module).forward is not nn.Embedding.forward:
            raise ScheduleValueError(f"FusedEmbedding.from_module: {type(module).__name__} overrides "
                                     f"nn.Embedding.forward: only a plain nn.Embedding's lookup is replaced")
        for option, value, default in (("max_norm", module.max_norm, None),
                                       ("scale_grad_by_freq", module.scale_grad_by_freq, False),
                                       ("sparse", module.sparse, False)):
            if value != default:
                raise ScheduleValueError(f"FusedEmbedding.from_module: {type(module).__name__} has "
                                         f"{option}={value!r}, which FusedEmbedding does not implement: only "
                                         f"{option}={default!r} is supported")
        # made on the meta device (nothing allocated, nothing drawn), then given the module's own weight
        new = cls(module.num_embeddings, module.embedding_dim, padding_idx=module.padding_idx, device="meta",
                  dtype=module.weight.dtype)
        new.weight = module.weight
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return embedding(input, self.weight, self.padding_idx)


def fused_embedding_like(path: str, old: nn.Module) -> FusedEmbedding:
    """``FusedEmbedding.from_module(old)``, in the ``make_fn(path, old_module)`` form ``replace_all`` calls.

    Example::

        sch.replace_all(nn.Embedding, fused_embedding_like)
    """
    return FusedEmbedding.from_module(old)


def fused_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` (same signature and result) on the rotary kernel.

    ``unsqueeze_dim=1``: q/k (B, H, S, D); ``unsqueeze_dim=2``: q/k (B, S, H, D).

    Example::

        q, k = fused_apply_rotary_pos_emb(q, k, cos, sin)
    """
    for name, value in (("q", q), ("k", k)):  # before transposing them below
        check_tensor("fused_apply_rotary_pos_emb", name, value, FLOATING_DTYPES)
    if unsqueeze_dim == 1:
        return apply_rotary(q, k, cos, sin)
    if unsqueeze_dim == 2:
        q_out, k_out = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    raise ScheduleValueError(f"fused_apply_rotary_pos_emb: unsqueeze_dim={unsqueeze_dim!r}: valid are 1 "
                             f"(q/k as (B, H, S, D)) and 2 ((B, S, H, D))")


def fused_causal_lm_loss(model_hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor,
                         ignore_index: int = -100, num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
                         chunk_size: Optional[int] = None) -> torch.Tensor:
    """HF's causal-LM loss of ``lm_head(model_hidden)`` against ``labels``, without the logits.

    As HF's ``ForCausalLMLoss``: position ``i`` predicts ``labels[..., i + 1]`` (the labels are shifted
    inside, the last position predicts nothing), ``ignore_index`` tokens do not count, and the loss is
    the mean over counted tokens, or the sum divided by ``num_items_in_batch`` when given (gradient
    accumulation). ``model_hidden`` (B, S, H) is the last hidden state (after the final norm);
    ``lm_head`` an ``nn.Linear`` (V, H).

    Example::

        hidden = model.model(input_ids).last_hidden_state
        loss = fused_causal_lm_loss(hidden, model.lm_head, input_ids)
    """
    check_tensor("fused_causal_lm_loss", "model_hidden", model_hidden, FLOATING_DTYPES, min_dim=1)
    check_integer_tensor("fused_causal_lm_loss", "labels", labels)
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ScheduleTypeError(f"fused_causal_lm_loss: lm_head {type(lm_head).__name__} has no 2-D weight: "
                                f"expected an nn.Linear (vocab, hidden)")
    if tuple(labels.shape) != tuple(model_hidden.shape[:-1]):
        raise ScheduleValueError(f"fused_causal_lm_loss: labels of shape {tuple(labels.shape)} do not fit hidden "
                                 f"states of shape {tuple(model_hidden.shape)}: expected {tuple(model_hidden.shape[:-1])}")
    labels = labels.to(model_hidden.device)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    bias = getattr(lm_head, "bias", None)
    hidden = model_hidden.to(weight.dtype) if model_hidden.dtype != weight.dtype else model_hidden
    if num_items_in_batch is None:
        return fused_linear_cross_entropy(hidden, weight, shifted, ignore_index=ignore_index, chunk_size=chunk_size,
                                          bias=bias)
    loss = fused_linear_cross_entropy(hidden, weight, shifted, ignore_index=ignore_index, reduction="sum",
                                      chunk_size=chunk_size, bias=bias)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
