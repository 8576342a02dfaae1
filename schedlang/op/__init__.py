"""Drop-in modules for schedules (Slapo's ``slapo.op``): attention with a selectable kernel,
fused MLP and linear variants, bias fusions, vocabulary-parallel cross entropy, ``Print``."""

from .attention import AttentionKernelError, FlashAttention, FlashAttentionOp
from .cross_entropy import ParallelCrossEntropy, vocab_parallel_cross_entropy
from .fused_bias import BiasGeLUFunction, bias_dropout, bias_gelu, bias_new_gelu, new_gelu
from .linear import FusedQKV, LinearWithAct, LinearWithDropout, LinearWithSeparateBias, LinearWithSyncFunc
from .mlp import FusedMLP
from .utils import Print

__all__ = ["FlashAttention", "FlashAttentionOp", "AttentionKernelError", "ParallelCrossEntropy",
           "vocab_parallel_cross_entropy", "FusedQKV", "LinearWithSeparateBias", "LinearWithSyncFunc", "LinearWithAct",
           "LinearWithDropout", "FusedMLP", "BiasGeLUFunction", "bias_gelu", "bias_new_gelu", "bias_dropout",
           "new_gelu", "Print"]
