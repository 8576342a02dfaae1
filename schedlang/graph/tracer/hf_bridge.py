"""What tracing a transformers model needs: mask builders and attention kernels as leaves, mask flags,
synthesized token inputs and the recorded call of a submodule."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import sys
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.fx as fx
from torch import nn

from ...errors import TraceError
from .common import _P, UNKNOWN, module_device, _new_fake_mode, forward_parameters
from .examples import _shape_only_syncs

# HF mask builders: they branch on tensor data and build masks with vmap; one node each.
_HF_MASK_FUNCTIONS = (
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_bidirectional_mask",
    "create_bidirectional_sliding_window_mask",
    "create_chunked_causal_mask",
    "create_masks_for_generate",
)


def _default_leaf_functions() -> List[Callable]:
    fns = []
    masking = sys.modules.get("transformers.masking_utils")
    if masking is not None:
        fns += [getattr(masking, n) for n in _HF_MASK_FUNCTIONS if callable(getattr(masking, n, None))]
    # the registered attention kernels decide `is_causal` from `mask is None` at run time (HF
    # drops an all-ones mask), so they must run as one call, also when a traced graph that
    # calls them by name is traced again
    interface = getattr(sys.modules.get("transformers.modeling_utils"), "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict):
        fns += [fn for fn in mapping.values() if callable(fn)]
    return fns


# flags HF models read from the config when they are None: trace without a KV cache
_RUNTIME_FLAG_DEFAULTS = {"use_cache": False, "output_attentions": False, "output_hidden_states": False}

# shape of the example input synthesized for an HF model: batch 2 and sequence 8 take the
# general branches (no broadcasting over batch 1, no single-token decoding path)
EXAMPLE_BATCH, EXAMPLE_SEQUENCE = 2, 8


def fake_ids_forward(model: nn.Module) -> Callable[[], Any]:
    """``model(input_ids=...)`` on fake ids of the example's shape, as a call to make: shapes and dtypes only, with
    the schedule's collectives reduced to their effect on shapes. Everything but the forward is prepared here, so
    the caller can tell a mistake of its own from the model's failure (which only the returned call raises)."""
    device = module_device(model)
    kwargs: Dict[str, Any] = {}
    if any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in forward_parameters(model)):
        kwargs["use_cache"] = False
    # a model on the meta device may keep buffers on the CPU (init_empty_weights without include_buffers); for
    # this one call they are meta too, so that fake tensors meet one device whatever the torch version (2.11
    # refuses to mix them)
    moved = ({n: b.to("meta") for n, b in model.named_buffers() if b.device.type != "meta"}
             if device.type == "meta" else {})

    def run():
        with _shape_only_syncs(), _new_fake_mode(), torch.no_grad():
            ids = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQUENCE, dtype=torch.long, device=device)
            if moved:
                return torch.func.functional_call(model, moved, (), {"input_ids": ids, **kwargs}, strict=False)
            return model(input_ids=ids, **kwargs)

    return run


#: the config given to ``trace(config=...)`` (Slapo's HF tracer option), for modules that hold none
_EXAMPLE_CONFIG: contextvars.ContextVar = contextvars.ContextVar("schedlang_example_config", default=None)


@contextlib.contextmanager
def example_config(config) -> Iterator[None]:
    """Shape synthesized examples from ``config`` (None: only from each module's own ``config``)."""
    token = _EXAMPLE_CONFIG.set(config)
    try:
        yield
    finally:
        _EXAMPLE_CONFIG.reset(token)


def _synthesize_example(module: nn.Module, name: str, make_example) -> Any:
    """Example for an HF model's token-level inputs: (batch, sequence) integer tensors; and, for a submodule
    whose config (its own, or the one given to ``trace``) has a ``hidden_size``, ``hidden_states`` of
    (batch, sequence, hidden_size) in the module's dtype."""
    config = getattr(module, "config", None) or _EXAMPLE_CONFIG.get()
    device = module_device(module)
    if device.type == "meta":
        device = torch.device("cpu")
    shape = (EXAMPLE_BATCH, EXAMPLE_SEQUENCE)
    if name == "hidden_states" and isinstance(getattr(config, "hidden_size", None), int):
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        return make_example(torch.zeros(shape + (config.hidden_size,), dtype=dtype, device=device))
    if name not in _HF_TOKEN_INPUTS or config is None or not getattr(config, "vocab_size", None):
        return UNKNOWN
    if name == "position_ids":
        return make_example(torch.arange(EXAMPLE_SEQUENCE, device=device).expand(shape))
    fill = 1 if name == "attention_mask" else 0
    return make_example(torch.full(shape, fill, dtype=torch.long, device=device))


_HF_TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


_MASK_SKIP_FLAGS = ("allow_is_causal_skip", "allow_is_bidirectional_skip")


def _keep_mask_flags(fn: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments that stop an HF mask builder from returning None at run time.

    On fake tensors HF always builds the mask; on real ones it returns None for an all-ones
    padding mask. The attention kernels that are leaf functions handle both, but eager
    attention is traced through and was specialized on a tensor mask, so for it the mask
    must always be built.
    """
    config = kwargs.get("config", args[0] if args else None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {flag: False for flag in _MASK_SKIP_FLAGS if flag in params and flag not in kwargs}


class _Captured(Exception):
    pass


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` looks like a transformers ``PreTrainedModel`` taking ``input_ids``."""
    config = getattr(module, "config", None)
    return (getattr(module, "main_input_name", None) == "input_ids" and config is not None
            and getattr(config, "vocab_size", None) is not None and not isinstance(module, fx.GraphModule))


def capture_call(container: nn.Module, target: nn.Module, fake_mode=None) -> Tuple[Tuple, Dict[str, Any]]:
    """Run the HF model ``container`` once on a synthesized fake ``input_ids`` and return the
    ``(args, kwargs)`` its submodule ``target`` is first called with (tensors are fake).

    Every forward hook is switched off during the run (no collectives are issued). Raises
    :class:`TraceError` if ``target`` is not reached.
    """
    fake_mode = fake_mode or _new_fake_mode()
    captured: Dict[str, Any] = {}

    def grab(mod, args, kwargs):
        captured["call"] = (args, kwargs)
        raise _Captured()

    saved = []
    for m in container.modules():
        saved.append((m, m._forward_hooks, m._forward_pre_hooks))
        m._forward_hooks, m._forward_pre_hooks = collections.OrderedDict(), collections.OrderedDict()
    handle = target.register_forward_pre_hook(grab, with_kwargs=True, prepend=True)
    params = {p.name for p in forward_parameters(container)}
    has_varkw = any(p.kind is _P.VAR_KEYWORD for p in forward_parameters(container))
    kwargs: Dict[str, Any] = {}
    if "use_cache" in params or has_varkw:
        kwargs["use_cache"] = False
    try:
        device = module_device(container)
        if device.type == "meta":
            device = torch.device("cpu")
        with _shape_only_syncs(), fake_mode, torch.no_grad():
            ids = torch.zeros(EXAMPLE_BATCH, EXAMPLE_SEQUENCE, dtype=torch.long, device=device)
            container(input_ids=ids, **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
        for m, fwd, pre in saved:
            m._forward_hooks, m._forward_pre_hooks = fwd, pre
    if "call" not in captured:
        raise TraceError(f"trace: {type(target).__name__} was not called when running {type(container).__name__}; "
                         "trace only a submodule that the model's forward calls")
    return captured["call"]


