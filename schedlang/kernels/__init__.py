"""Hand-written Triton kernels, each with a pure-PyTorch reference beside it (``<name>_reference.py``).

Training-step kernels (forward and backward; the reference runs for CPU tensors unless
``TRITON_INTERPRET=1``):

* :func:`fused_linear_cross_entropy`, :func:`vocab_parallel_fused_linear_cross_entropy`: LM head + loss
  chunked over tokens, without the full logits;
* :func:`rms_norm`: RMSNorm with HF LLaMA's casts, optionally fused with the residual add;
* :func:`apply_rotary`: rotary embedding of q and k;
* :func:`swiglu`: ``silu(gate) * up``;
* :func:`embedding`: token lookup (``F.embedding``) whose weight gradient comes from deterministic kernels
  (no zero fill, no atomics).

Drop-in modules wrapping them are in :mod:`schedlang.kernels.modules`. Importing this package
imports Triton.
"""

from schedlang.kernels.embedding import embedding
from schedlang.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from schedlang.kernels.rms_norm import rms_norm
from schedlang.kernels.rotary import apply_rotary
from schedlang.kernels.swiglu import swiglu
from schedlang.kernels.vocab_parallel_fused_linear_cross_entropy import vocab_parallel_fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy", "vocab_parallel_fused_linear_cross_entropy", "rms_norm", "apply_rotary",
           "swiglu", "embedding"]
