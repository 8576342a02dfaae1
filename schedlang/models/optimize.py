"""``optimize_model``: the single-device speed-ups for HF transformer models, written into a schedule.

What it does, each part through the schedule where a primitive exists (so it is in the plan):

* **norms**: every ``*RMSNorm`` (LLaMA, Mistral, Qwen2) becomes ``schedlang.kernels.modules.FusedRMSNorm``
  (``replace_all``), sharing the original weight;
* **embedding**: the token embedding (a plain ``nn.Embedding``) becomes
  ``schedlang.kernels.modules.FusedEmbedding`` (``replace``), sharing its weight: the same lookup, and the
  weight's gradient from deterministic Triton kernels instead of PyTorch's sort, fill and scatter;
* **loss**: the causal-LM head becomes :class:`FusedLinearCrossEntropyHead` (``replace``), which
  shares the head's weight (and so its tie to the embedding). When the model is called with
  ``labels=``, the head hands the hidden states to the loss instead of computing logits, and the
  loss is ``schedlang.kernels.fused_linear_cross_entropy``: the ``tokens x vocab`` logits never
  exist. ``out.loss`` is the usual mean over counted tokens; ``out.logits`` is ``None``. Without
  labels the head returns logits as a Linear does;
* **attention**: the SDPA backend, chosen by a short probe of GPU time on the GPU (cuDNN, Flash,
  memory-efficient; the fastest forward + backward at the model's shapes and q/k/v layout) and pinned
  inside every decoder layer when it beats PyTorch's default; otherwise (and on the CPU) the default
  is kept;
* **masks**: transformers' packed-sequence check waits for the GPU once per forward; for calls
  without ``position_ids`` (the model counts positions up itself, so nothing is packed) it is
  answered without asking the GPU (:mod:`schedlang.models.packed_sequences`); and while a CUDA graph is
  captured (a whole step under :class:`schedlang.CapturedStep`), a call without a padding mask leaves the
  causal mask to SDPA as it does outside the capture, so the layers compiled during the warm-up steps
  meet the inputs they were compiled for (:mod:`schedlang.models.capture_masks`);
* **checkpointing** (``selective_checkpoint``): ``checkpoint()`` on every layer or every n-th one;
* **float8** (``float8="tensorwise"`` / ``"rowwise"``): the decoder layers' Linears become torchao's
  float8 training Linears (the ``float8`` primitive, with its skip rules);
* **compilation** (``compile="layers"``): every decoder layer's forward compiled on its own
  (:func:`schedlang.models.compile_layers`); ``torch.compile`` is lazy, so this costs nothing until
  the first step.

Kernels come from :mod:`schedlang.kernels`, imported when needed; if one is missing (or a part does
not apply, e.g. a head already sharded over a tensor-parallel group) that part is skipped and the
reason logged (``logging.getLogger("schedlang.models.optimize")``) and recorded in
``sch.metadata["optimize"]``. Call it last, after ``shard_model`` / ``fully_shard``, just before
``build``::

    sch = schedlang.create_schedule(model)
    optimize_model(sch)
    model, opt = schedlang.build(sch, optimizer="adamw", lr=1e-4)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..errors import ScheduleValueError
from ..module_record import shard_specs
from .capture_masks import keep_causal_mask_skip_under_capture
from .packed_sequences import skip_packed_sequence_check

logger = logging.getLogger("schedlang.models.optimize")

__all__ = ["optimize_model", "FusedLinearCrossEntropyHead", "choose_sdpa_backend", "SDPA_LAYOUTS", "COMPILE_MODES",
           "SDPA_BACKENDS"]

COMPILE_MODES = ("layers", "layers-cudagraphs", None)
SDPA_BACKENDS = ("auto", "default", "cudnn", "flash", "efficient", "math")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
COMPILED_NORMS = ("inductor", "kernel")  # schedlang.kernels.rms_norm.COMPILED_FORMS, without importing Triton
LAYER_LISTS = ("layers", "h", "layer")
IGNORE_INDEX = -100


def _kernel(name: str):
    """``schedlang.kernels.<name>`` (functions) or ``schedlang.kernels.modules.<name>`` (modules), or None and
    why."""
    try:
        from .. import kernels
    except ImportError as e:  # Triton missing
        return None, f"schedlang.kernels cannot be imported ({e})"
    found = getattr(kernels, name, None)
    if found is None:
        try:
            from ..kernels import modules
        except ImportError:
            modules = None
        found = getattr(modules, name, None)
    return (found, "") if found is not None else (None, f"schedlang.kernels has no {name}")


# ------------------------------------------------------------------------------------------------- norms
def _rms_norm_eps(module: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return 1e-6


def fused_rms_norm_like(path: str, old: nn.Module, compiled: str = "inductor") -> nn.Module:
    """A ``FusedRMSNorm`` computing what ``old`` (a HF RMSNorm) does, holding the same weight Parameter;
    ``compiled`` is its form inside compiled layers (``"inductor"`` or ``"kernel"``)."""
    fused_cls, why = _kernel("FusedRMSNorm")
    if fused_cls is None:
        raise ImportError(why)
    if hasattr(fused_cls, "from_module"):
        return fused_cls.from_module(old, compiled=compiled)
    new = fused_cls(old.weight.shape[0], eps=_rms_norm_eps(old), compiled=compiled)
    new.weight = old.weight
    return new


def _has_sync(module: nn.Module) -> bool:
    """A norm carrying the schedule's collectives (sequence parallelism) keeps its class."""
    from ..distributed.sequence_parallel import is_sequence_parallel_norm

    return bool(module._forward_hooks or module._forward_pre_hooks) or is_sequence_parallel_norm(module)


def _computes_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` computes LLaMA's RMSNorm, ``x / rms(x) * weight``, which FusedRMSNorm replaces: tried on
    a CPU copy with random weights (a meta-device model included); Gemma's ``x / rms(x) * (1 + weight)`` is not."""
    import copy

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    try:
        probe = copy.deepcopy(module)
        probe = probe.to_empty(device="cpu") if weight.is_meta else probe.to("cpu")
        gen = torch.Generator().manual_seed(0)
        w = torch.rand(weight.shape, generator=gen) + 0.5
        x = torch.randn(3, weight.shape[0], generator=gen)
        with torch.no_grad():
            probe.weight.copy_(w)
            got = probe(x)
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _rms_norm_eps(module)) * w
        return isinstance(got, torch.Tensor) and torch.allclose(got.float(), expected, rtol=1e-3, atol=1e-4)
    except Exception:  # a norm that cannot be copied or called on its own: kept as it is
        return False


def _fuse_norms(sch, done: List[str], skipped: Dict[str, str], compiled: str = "inductor") -> None:
    fused_cls, why = _kernel("FusedRMSNorm")
    if fused_cls is None:
        skipped["norms"] = why
        return
    types = {type(m) for m in sch.mod.modules() if type(m).__name__.endswith("RMSNorm") and m is not sch.mod}
    types.discard(fused_cls)
    if not types:
        skipped["norms"] = "no RMSNorm in the model (LayerNorm is left to torch.compile)"
        return
    for norm_type in sorted(types, key=lambda t: t.__name__):
        sample = next(m for m in sch.mod.modules() if isinstance(m, norm_type))
        if not _computes_rms_norm(sample):
            skipped["norms"] = f"{norm_type.__name__} computes another norm than LLaMA's (e.g. Gemma's 1 + weight); kept"
            continue
        if any(_has_sync(m) for m in sch.mod.modules() if isinstance(m, norm_type)):
            skipped["norms"] = f"{norm_type.__name__} carries sequence-parallel collectives; kept"
            continue
        paths = sch.replace_all(norm_type, fused_rms_norm_like, compiled=compiled)
        where = "" if compiled == "inductor" else " (schedlang's kernels as operators in compiled layers)"
        done.append(f"norms: {len(paths)} x {norm_type.__name__} -> FusedRMSNorm{where}")


# ------------------------------------------------------------------------------------------- embedding
def _fuse_embedding(sch, done: List[str], skipped: Dict[str, str]) -> None:
    """The model's token embedding becomes a ``FusedEmbedding`` (the same weight Parameter): PyTorch's backward of
    an embedding sorts the ids in eight radix passes, zeroes the whole gradient and writes it in two more kernels
    (about 390 us for LLaMA-1.1B's 8192 tokens on an H200); schedlang's kernels write every row of the gradient
    once, summing each id's rows in a fixed order (:mod:`schedlang.kernels.embedding`). Only the token
    embedding: an embedding of a handful of rows (BERT's token types) would leave most of the GPU to the
    programs of a few ids."""
    root = sch.root
    get = getattr(root.mod, "get_input_embeddings", None)
    try:
        embed = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        embed = None
    path = next((name for name, m in root.mod.named_modules() if m is embed), None) if embed is not None else None
    if not path:
        skipped["embedding"] = f"{type(root.mod).__name__} names no input embedding (get_input_embeddings)"
        return
    fused_cls, why = _kernel("FusedEmbedding")
    if fused_cls is not None and type(embed) is fused_cls:
        skipped["embedding"] = "the input embedding is already a FusedEmbedding"
        return
    if type(embed) is not nn.Embedding:
        skipped["embedding"] = (f"the input embedding '{path}' is a {type(embed).__name__}, not a plain nn.Embedding "
                                "(a scaled or sharded embedding computes more than the lookup); kept")
        return
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        skipped["embedding"] = (f"the input embedding '{path}' sets max_norm, scale_grad_by_freq or sparse, which "
                                "FusedEmbedding does not compute; kept")
        return
    hooked = embed._forward_hooks or embed._forward_pre_hooks
    if shard_specs(embed) or hooked or type(embed.weight.data) is not torch.Tensor:
        skipped["embedding"] = f"the input embedding '{path}' is sharded or hooked; kept"
        return
    if fused_cls is None:
        skipped["embedding"] = why
        return
    root[path].replace(fused_cls.from_module(embed))
    done.append(f"embedding: {path} -> FusedEmbedding (its weight's gradient from deterministic Triton kernels)")


# -------------------------------------------------------------------------------------------------- loss
class _HiddenForLoss:
    """What the head returns instead of logits when the call has labels: the loss takes it from here."""

    __slots__ = ("hidden", "head")

    def __init__(self, hidden: torch.Tensor, head: "FusedLinearCrossEntropyHead"):
        self.hidden, self.head = hidden, head


class FusedLinearCrossEntropyHead(nn.Linear):
    """A causal-LM head whose loss is computed with the projection, without materializing the logits.

    It holds the original head's ``weight`` (and ``bias``) Parameters. Called on its own it is the
    Linear it replaced. Inside a model call with ``labels=`` (see :class:`_LabelsGiven`), it returns
    the hidden states to the model's ``loss_function`` (:class:`FusedCausalLMLoss`), which computes
    ``cross_entropy(hidden @ weight.T + bias, shifted labels)`` in one fused kernel.
    """

    #: the weight is read only as a matmul operand in the compute dtype, so
    #: :func:`schedlang.optim.master_weight_groups` gives it an fp32 master and a bf16 copy like a Linear's (no
    #: cast of the vocabulary's weight each forward, nor of its gradient each backward)
    weight_is_matmul_operand = True

    def __init__(self, head: nn.Linear):
        with torch.device("meta"):
            super().__init__(head.in_features, head.out_features, bias=head.bias is not None)
        self.weight = head.weight
        if head.bias is not None:
            self.bias = head.bias
        self.defer = False  # set for the duration of a model call with labels

    def forward(self, hidden: torch.Tensor):
        if self.defer:
            return _HiddenForLoss(hidden, self)
        return F.linear(hidden, self.weight, self.bias)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
             reduction: str = "mean") -> torch.Tensor:
        """Cross entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` (already aligned)."""
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1).to(hidden.device)
        weight, bias = self.weight, self.bias
        device_type = hidden.device.type
        if torch.is_autocast_enabled(device_type):
            # the projection in the autocast dtype, as the Linear it replaces would run (a custom kernel is
            # not cast by autocast itself); the statistics of the loss stay in fp32 inside the kernel
            dtype = torch.get_autocast_dtype(device_type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        fused, why = _kernel("fused_linear_cross_entropy")
        if fused is not None:
            try:
                return fused(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction,
                             **({} if bias is None else {"bias": bias}))
            except TypeError as e:  # another signature than expected: say so once, then compute it plainly
                why = f"schedlang.kernels.fused_linear_cross_entropy: {e}"
        _log_once(f"fused linear + cross entropy unavailable ({why}); computing the logits")
        logits = F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype))
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction=reduction)


_LOGGED = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


class FusedCausalLMLoss:
    """HF ``loss_function`` for a model whose head is a :class:`FusedLinearCrossEntropyHead`: labels shifted
    by one as HF's causal-LM loss does, the mean over tokens whose label is not ``ignore_index``."""

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        if isinstance(logits, _HiddenForLoss):
            loss = logits.head.loss(logits.hidden, shift_labels, ignore_index, reduction)
        else:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(
                logits.device), ignore_index=ignore_index, reduction=reduction)
        if num_items_in_batch is not None:
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
        return loss


class _LabelsGiven:
    """Root forward pre-hook (with kwargs): a call with ``labels=`` makes the head defer to the loss."""

    def __init__(self, head: FusedLinearCrossEntropyHead):
        self.head = head

    def __call__(self, module, args, kwargs):
        self.head.defer = kwargs.get("labels") is not None
        return None


class _ClearDeferred:
    """Root forward hook: the output never carries the hidden states in place of logits."""

    def __init__(self, head: FusedLinearCrossEntropyHead):
        self.head = head

    def __call__(self, module, args, output):
        self.head.defer = False
        if isinstance(getattr(output, "logits", None), _HiddenForLoss):
            output.logits = None
        return output


def _fuse_loss(sch, done: List[str], skipped: Dict[str, str]) -> None:
    root = sch.root
    head_path = "lm_head"
    if head_path not in root.child or not isinstance(root[head_path].mod, nn.Linear):
        skipped["loss"] = f"{type(root.mod).__name__} has no causal-LM head 'lm_head' (nn.Linear)"
        return
    if not hasattr(type(root.mod), "loss_function") or "MaskedLM" in str(getattr(root.mod, "loss_type", "")):
        skipped["loss"] = f"{type(root.mod).__name__} is not a causal LM with an HF loss_function"
        return
    config = getattr(root.mod, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        skipped["loss"] = (f"{type(root.mod).__name__} transforms its logits after the head (softcapping or scaling), "
                           "which the fused loss would skip")
        return
    head = root[head_path].mod
    if isinstance(head, FusedLinearCrossEntropyHead):
        skipped["loss"] = "the head is already fused"
        return
    if shard_specs(head) or head._forward_hooks or head._forward_pre_hooks:
        skipped["loss"] = ("the head is sharded over the tensor-parallel group; its logits stay split and the "
                           "vocabulary-parallel loss is kept")
        return
    new = FusedLinearCrossEntropyHead(head)
    root[head_path].replace(new)
    new = root[head_path].mod
    model = root.mod
    model.register_forward_pre_hook(_LabelsGiven(new), with_kwargs=True)
    model.register_forward_hook(_ClearDeferred(new))
    model.loss_function = FusedCausalLMLoss()
    fused, why = _kernel("fused_linear_cross_entropy")
    done.append("loss: lm_head -> fused linear + cross entropy" + ("" if fused else f" (fallback: {why})"))


# --------------------------------------------------------------------------------------------- attention
def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


#: how a model lays out the q, k, v it gives SDPA (the probe times the backends on the same layout:
#: some copy strided inputs, and a backend fast on contiguous tensors can be slow on the model's own)
SDPA_LAYOUTS = ("heads-first", "per-projection", "fused-qkv")


def _probe_inputs(batch: int, heads: int, seq: int, head_dim: int, dtype, device, layout: str, gen):
    """q, k, v and the output's gradient as a model of this ``layout`` hands them to SDPA: all (B, H, S, D)
    shaped; ``heads-first`` contiguous; ``per-projection`` each the (B, S, H, D) output of its own projection,
    transposed (LLaMA); ``fused-qkv`` three slices of one (B, S, 3, H, D) projection, transposed (GPT-2's
    ``c_attn``). The gradient arrives as the transpose of a (B, S, H, D) tensor, as from the output projection."""
    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    if layout == "heads-first":
        qkv = [randn(batch, heads, seq, head_dim).requires_grad_() for _ in range(3)]
        return qkv, qkv, randn(batch, heads, seq, head_dim)
    grad = randn(batch, seq, heads, head_dim).transpose(1, 2)
    if layout == "per-projection":
        leaves = [randn(batch, seq, heads, head_dim).requires_grad_() for _ in range(3)]
        return leaves, [t.transpose(1, 2) for t in leaves], grad
    packed = randn(batch, seq, 3, heads, head_dim).requires_grad_()
    return [packed], [packed[:, :, i].transpose(1, 2) for i in range(3)], grad


def _gpu_ms_per_call(run, device: torch.device, repeats: int) -> float:
    """GPU time of one ``run()``: the kernels back to back, not the host's rate of launching them. A sleep
    kernel holds the GPU while the host queues every timed call, so the events between them time only the
    GPU's work; at these sizes a host launching fwd + bwd is slower than the kernels it launches."""
    run()
    run()  # the first calls build plans and pick kernels
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold = getattr(torch.cuda, "_sleep", None)  # a private helper: without it, the events time host and GPU
    if hold is not None:
        hold(100_000_000)  # tens of ms at GPU clocks: longer than queueing the calls below
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def choose_sdpa_backend(batch: int, heads: int, seq: int, head_dim: int, dtype=torch.bfloat16,
                        device: Optional[torch.device] = None, causal: bool = True, repeats: int = 5,
                        layout: str = "heads-first", margin: float = 0.03) -> Optional[str]:
    """The fastest SDPA backend (forward + backward, GPU time) at these shapes and this q/k/v ``layout`` (one
    of SDPA_LAYOUTS) on the current GPU, by measurement. None (keep PyTorch's own choice) on the CPU, when
    no backend runs, or when no backend beats PyTorch's default by more than ``margin``: a pin is worth
    making only where it is measurably faster."""
    if layout not in SDPA_LAYOUTS:
        raise ScheduleValueError(f"choose_sdpa_backend: invalid layout {layout!r}: valid are "
                                 f"{', '.join(map(repr, SDPA_LAYOUTS))}")
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None)
    if device is None or device.type != "cuda":
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    leaves, (q, k, v), grad = _probe_inputs(batch, heads, seq, head_dim, dtype, device, layout, gen)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, leaves, grad)  # to the leaves, as the model's backward reaches its projections

    times = {}
    for name, backend in [("default", None)] + [(n, b) for n, b in _sdpa_backends().items() if n != "math"]:
        try:
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                times[name] = _gpu_ms_per_call(fwd_bwd, device, repeats)
        except RuntimeError as e:  # not supported at these shapes / on this GPU
            logger.info("SDPA probe: %s unavailable (%s)", name, str(e).splitlines()[0][:200])
    pinned = {n: t for n, t in times.items() if n != "default"}
    if not pinned:
        return None
    best = min(pinned, key=pinned.get)
    beats_default = "default" not in times or pinned[best] <= (1 - margin) * times["default"]
    choice = best if beats_default else None
    logger.info("SDPA probe (b%d h%d s%d d%d, %s; GPU ms per fwd+bwd): %s -> %s", batch, heads, seq, head_dim,
                layout, ", ".join(f"{n} {t:.3f}" for n, t in sorted(times.items())), choice or "PyTorch's default")
    return choice


class _WithSDPABackend:
    """A layer's forward run with the SDPA backend pinned; ``compile_layers`` compiles it with the layer, so the
    pin is traced (no graph break) and the graph holds the chosen kernel. An object rather than a closure:
    copies of an uncompiled model call their own layer."""

    def __init__(self, layer: nn.Module, backend: str):
        self.layer, self.backend = layer, backend
        self.inner = layer.__dict__.get("forward")  # an instance forward (checkpoint, compile) or the class's

    def __call__(self, *args, **kwargs):
        # the chosen backend first; the others stay allowed for shapes it cannot take (masks, odd head dims)
        order = [self.backend] + [n for n in ("flash", "efficient", "cudnn", "math") if n != self.backend]
        with sdpa_kernel([_sdpa_backends()[n] for n in order], set_priority=True):
            if self.inner is not None:
                return self.inner(*args, **kwargs)
            # the class's forward called with the layer, not bound through __get__: torch 2.11's compiler
            # cannot trace function.__get__ and would break the layer's graph there
            return type(self.layer).forward(self.layer, *args, **kwargs)


def _layers(model: nn.Module) -> List[nn.Module]:
    out = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LAYER_LISTS and isinstance(module, nn.ModuleList):
            out.extend(module)
    return out


def _layer_paths(sch) -> List[str]:
    paths = []
    for name, module in sch.mod.named_modules():
        if name.rpartition(".")[2] in LAYER_LISTS and isinstance(module, nn.ModuleList):
            paths.extend(f"{name}.{i}" for i in range(len(module)))
    return paths


def _attention_shapes(config) -> Dict[str, int]:
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    seq = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 1024)
    # GPT-2 computes q, k, v with one fused projection (c_attn) and slices them; LLaMA and BERT with three
    layout = "fused-qkv" if getattr(config, "model_type", None) == "gpt2" else "per-projection"
    return {"heads": heads, "head_dim": hidden // heads, "seq": min(seq, 2048), "layout": layout}


# ------------------------------------------------------------------------------------------------- entry
def optimize_model(sch, *, fused_kernels: bool = True, compile: Optional[str] = "layers", sdpa_backend: str = "auto",
                   selective_checkpoint: Union[None, str, int] = None, float8: Optional[str] = None,
                   fuse_projections: bool = False, compile_options: Optional[dict] = None,
                   compiled_norms: str = "inductor"):
    """Write the single-device speed-ups into ``sch`` (see the module docstring); returns ``sch``.

    Arguments:
        sch: schedule of a HF LLaMA-, GPT-2- or BERT-like model (any view; the whole model is used).
        fused_kernels: fused RMSNorm and fused linear + cross-entropy loss from :mod:`schedlang.kernels`.
        compile: ``"layers"`` (each decoder layer compiled on its own), ``"layers-cudagraphs"`` (the same,
            replayed from CUDA graphs: for host-bound steps; a step's shapes must not change) or None.
            Float8 steps are the usual host-bound case: the GEMMs get faster while the many small
            scaling kernels cost the host as much as before, so ``float8=`` pairs well with
            ``"layers-cudagraphs"`` (compare both with ``bench/bench_train.py --work llama-1.1b-1gpu-fp8``).
        sdpa_backend: ``"auto"`` (measured on the GPU; default on the CPU), ``"default"`` (leave it to
            PyTorch), or one of ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``.
        selective_checkpoint: None, ``"all"`` (every layer) or n (every n-th layer, from the first).
        float8: None, ``"tensorwise"`` or ``"rowwise"`` (torchao float8 training of the layers' Linears).
        fuse_projections: in the compiled layers, the linears that read one input (q, k and v; gate and up)
            run as one GEMM on their weights concatenated per call (the parameters stay as they are);
            needs ``compile``. Off by default: whether it pays depends on the shapes and the GPU
            (``bench/probe_llama_parts.py`` times both forms).
        compiled_norms: what the compiled layers run for the fused norms: ``"inductor"`` (default: Inductor's
            code for the PyTorch reference, fused with its neighbours) or ``"kernel"`` (schedlang's Triton
            kernels as custom operators, which Inductor cannot fuse with anything; 4% slower in a
            LLaMA-1.1B step on an H100: ``bench/bench_train.py`` variant ``schedlang-optimize-mw-knorm``).
        compile_options: more ``torch.compile`` arguments for the layers, e.g.
            ``{"options": {"coordinate_descent_tuning": True}}`` (Inductor tunes its kernels' block sizes
            once, at compile time); ``"layers-cudagraphs"`` adds its mode to them.

    What was applied and what was skipped (and why) is in ``sch.metadata["optimize"]``.

    Example::

        sch = schedlang.create_schedule(LlamaForCausalLM(config))
        optimize_model(sch, sdpa_backend="auto")
        model, opt = schedlang.build(sch, optimizer="adamw", lr=1e-4)
    """
    root = sch.root
    if compile not in COMPILE_MODES:
        raise ScheduleValueError(f"optimize_model: invalid compile {compile!r}: valid are 'layers', "
                                 "'layers-cudagraphs' or None")
    if sdpa_backend not in SDPA_BACKENDS:
        raise ScheduleValueError(f"optimize_model: invalid sdpa_backend {sdpa_backend!r}: valid are "
                                 f"{', '.join(SDPA_BACKENDS)}")
    if compile_options is not None and not isinstance(compile_options, dict):
        raise ScheduleValueError(f"optimize_model: compile_options must be a dict of torch.compile arguments or "
                                 f"None, got {type(compile_options).__name__}")
    if compile_options and compile is None:
        raise ScheduleValueError("optimize_model: compile_options were given, but compile=None compiles nothing; "
                                 "pass compile='layers' or 'layers-cudagraphs'")
    if compile is not None:
        from .compiling import _check_compile_options

        # torch.compile itself would refuse them only at the first layer, after the other parts were applied;
        # checked with the mode "layers-cudagraphs" adds, as compile_layers will receive them
        _check_compile_options("optimize_model", _layer_compile_options(compile, compile_options))
    if not isinstance(fuse_projections, bool):
        raise ScheduleValueError(f"optimize_model: fuse_projections must be True or False, got {fuse_projections!r}")
    if compiled_norms not in COMPILED_NORMS:
        raise ScheduleValueError(f"optimize_model: invalid compiled_norms {compiled_norms!r}: valid are "
                                 f"{', '.join(map(repr, COMPILED_NORMS))}")
    if fuse_projections and compile is None:
        raise ScheduleValueError("optimize_model: fuse_projections=True rewrites the compiled layers' graphs, but "
                                 "compile=None compiles none; pass compile='layers' or 'layers-cudagraphs'")
    if float8 is not None and float8 not in FLOAT8_RECIPES:
        raise ScheduleValueError(f"optimize_model: invalid float8 {float8!r}: valid are None, "
                                 f"{', '.join(map(repr, FLOAT8_RECIPES))}")
    every = _checkpoint_stride(selective_checkpoint)
    layer_paths = _layer_paths(root)
    if not layer_paths:
        raise ScheduleValueError(f"optimize_model: no layer list ({', '.join(LAYER_LISTS)}) found in "
                                 f"{type(root.mod).__name__}: expected a HF LLaMA-, GPT-2- or BERT-like model")
    done: List[str] = []
    skipped: Dict[str, str] = {}
    # everything below, the attention pin and the compiled layers included, is undone if any part fails
    with root.atomic():
        if fused_kernels:
            _fuse_norms(root, done, skipped, compiled_norms)
            _fuse_embedding(root, done, skipped)
            _fuse_loss(root, done, skipped)
        if float8 is not None:
            _float8(root, layer_paths, float8, done)
        if skip_packed_sequence_check(root.mod):
            done.append("masks: no host sync in transformers' packed-sequence check for positions the model makes")
        else:
            skipped["masks"] = ("this transformers has no packed-sequence check, or the model derives its positions "
                                "from more than the token count (multimodal)")
        if keep_causal_mask_skip_under_capture(root.mod):
            done.append("capture: without a padding mask, the causal mask is left to SDPA also while a CUDA graph is "
                        "captured (a whole step captured by schedlang.CapturedStep compiles nothing again)")
        else:
            skipped["capture"] = "this transformers has no causal-mask skip check for SDPA"
        if every:
            for path in layer_paths[::every]:
                root[path].checkpoint()
            done.append(f"checkpoint: {len(layer_paths[::every])} of {len(layer_paths)} layers")
        backend = _resolve_sdpa(root, sdpa_backend, skipped)
        if backend is not None:
            # pinned inside each layer's forward before it is compiled: the compiler traces the pin and the chosen
            # attention kernel into the layer's graph, so no Python context manager runs on every call
            for layer in _layers(root.mod):
                layer.forward = _WithSDPABackend(layer, backend)
            done.append(f"sdpa: {backend}")
        if compile in ("layers", "layers-cudagraphs"):
            from .compiling import compile_layers

            options = _layer_compile_options(compile, compile_options)
            done.append(f"compile: {compile_layers(root.mod, fuse_projections=fuse_projections, **options)} layers"
                        + (" (CUDA graphs)" if compile == "layers-cudagraphs" else "")
                        + (f" with {compile_options}" if compile_options else "")
                        + (", linears on one input as one GEMM" if fuse_projections else ""))
        root.metadata["optimize"] = {"applied": done, "skipped": skipped, "sdpa_backend": backend}
    for part, why in skipped.items():
        logger.info("optimize_model: %s skipped: %s", part, why)
    return sch


def _layer_compile_options(compile: str, compile_options: Optional[dict]) -> dict:
    """The torch.compile arguments each layer gets: the caller's, with the mode ``"layers-cudagraphs"`` means."""
    options = dict(compile_options or {})
    if compile == "layers-cudagraphs":
        # each compiled layer replays its forward and backward kernels from CUDA graphs (torch.compile's
        # cudagraph trees), which takes the launch cost off the host where a step is host-bound; the model's
        # own Python between layers (masks, the loss) stays eager
        options["mode"] = "reduce-overhead"
    return options


def _checkpoint_stride(selective_checkpoint) -> int:
    if selective_checkpoint is None:
        return 0
    if selective_checkpoint == "all":
        return 1
    if isinstance(selective_checkpoint, int) and not isinstance(selective_checkpoint, bool) and selective_checkpoint > 0:
        return selective_checkpoint
    raise ScheduleValueError(f"optimize_model: invalid selective_checkpoint {selective_checkpoint!r}: valid are None, "
                             "'all' or a positive int n (every n-th layer)")


def _float8(root, layer_paths: List[str], recipe: str, done: List[str]) -> None:
    # the float8 primitive picks the Linears (alignment, LM head, size) and says why it skips any;
    # a missing torchao is an error here too: float8 was asked for, so it is not quietly dropped
    count = sum(len(root[path].float8(recipe=recipe)["converted"]) for path in layer_paths)
    done.append(f"float8 ({recipe}): {count} Linears")


def _resolve_sdpa(root, sdpa_backend: str, skipped: Dict[str, str]) -> Optional[str]:
    if sdpa_backend == "default":
        return None
    if sdpa_backend != "auto":
        return sdpa_backend
    param = next(iter(root.mod.parameters()), None)
    on_gpu = torch.cuda.is_available() and param is not None and param.device.type in ("cuda", "meta")
    config = getattr(root.mod, "config", None)
    if not on_gpu or config is None:
        skipped["sdpa"] = "not on a GPU: PyTorch's default backend"
        return None
    shapes = _attention_shapes(config)
    choice = None
    with contextlib.suppress(Exception):
        choice = choose_sdpa_backend(batch=max(1, 8192 // shapes["seq"]), heads=shapes["heads"], seq=shapes["seq"],
                                     head_dim=shapes["head_dim"], layout=shapes["layout"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # every rank takes rank 0's measurement, so that all compute attention the same way
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    if choice is None:
        skipped["sdpa"] = "the probe found no backend faster than PyTorch's default: PyTorch's default"
    return choice
