"""Hierarchy-keeping FX tracing that works on transformers 5.x models.

``trace_module(module)`` turns ``module`` into a :class:`TracedModule` (an
``fx.GraphModule``). By default every traced child becomes its own ``TracedModule`` at the
same path, so ``sch["layers.0.mlp"]`` still names the MLP after its parent was traced;
``flatten=True`` inlines the children into one graph instead. Leaf modules (``torch.nn``
built-ins, schedlang's sync ops, checkpointed modules, fused kernels, HF ``Conv1D`` and the
types or names given in ``leaf_modules``) stay ``call_module`` nodes.

How models with Python control flow are traced
-----------------------------------------------
HF models branch on shapes (``if q_len > 1``), unpack shapes (``(*x.shape[:-1], -1, d)``)
and build masks with data-dependent shortcuts. Plain ``torch.fx.symbolic_trace`` fails on
all three. This tracer keeps shapes symbolic in the graph but also carries an *example
value* for every node: a ``FakeTensor`` (shape, dtype, device, no data) computed by running
each operation under ``FakeTensorMode``. When Python needs a concrete answer (``bool``,
``len``, iteration), the example answers it, and the graph is *specialized* on that answer
(logged at DEBUG level). The generated code checks the answer each time it runs
(:func:`~.specialization.check_traced_condition`, :func:`~.specialization.check_traced_length`)
and raises :class:`TraceError` on inputs that would take the other branch or loop another
number of times; a condition is a Python value there (from shapes, dtypes, lengths), so the
check costs no device sync, and ``torch.compile`` turns it into guards of its own. A shape's
own length (the rank) is not checked: ops on a wrong rank fail by themselves. Examples come from

* tensors given in ``concrete_args`` (an example input: the argument stays a graph input);
* a synthesized ``input_ids`` of shape (2, 8) for an HF model (``main_input_name``);
* for a submodule of an HF model traced on its own, the arguments it really receives:
  the enclosing model runs once under ``FakeTensorMode`` and the call is recorded
  (:func:`capture_call`); tensor arguments become inputs, the rest is specialized;
* the call as recorded while tracing the parent, for every traced child.

Arguments of the traced ``forward`` that are not inputs are *specialized*: their value is
baked into the graph and a guard in the generated code raises :class:`TraceError` if the
module is later called with a different one. By default the inputs are the parameters
without a default plus an HF model's main input; every other parameter keeps its default,
with ``use_cache=False`` (no KV cache: the graph is a training / prefill graph). Pass
``concrete_args={"attention_mask": PH}`` to make an optional argument an input.

Functions that cannot be traced symbolically are recorded as one ``call_function`` node
(:func:`register_leaf_function`): HF's mask builders (``create_causal_mask`` ...) and the
registered attention kernels (``sdpa_attention_forward`` ...; ``eager_attention_forward``
is traced through, so its matmul/softmax are visible). A module passed to a leaf function
is replaced by a snapshot of its plain attributes (:class:`ModuleAttributes`).

What survives tracing: parameters and buffers (same objects, same qualified names, even
those the graph does not use), ``_schedlang_*`` attributes such as each module's record
(:mod:`schedlang.module_record`: shards, syncs, checkpointing), sync-op children and the
forward hooks of every module that is replaced by a ``TracedModule``, container types (``ModuleList``), non-persistent buffers, and the plain attributes of the
original module (``config``, ...). The Python values of the arguments are frozen at trace
time. ``self.training`` is too, but the module is traced in both modes: calls that differ only
in constants (functional dropout's ``training`` flag, the ``dropout`` transformers passes its
attention kernels) are rewritten to follow the mode when they run, and a graph that differs in
more than that refuses to run in the other mode (:mod:`.training_mode`).

Example::

    gm = trace_module(model.layers[0].mlp)
    print(gm.code)

The pieces, one concern each:

* :mod:`.core` - :class:`SchedlangTracer`, one graph per traced child module;
* :mod:`.examples` - example-value propagation on fake tensors;
* :mod:`.call_spec` - which arguments of a ``forward`` are inputs and which are specialized;
* :mod:`.specialization` - the guard generated code runs on specialized arguments;
* :mod:`.training_mode` - the guard on the training mode a graph was traced in;
* :mod:`.leaf_policy` - what stays one node (leaf functions, sync ops, ``Conv1D``);
* :mod:`.hf_bridge` - transformers' mask builders, attention kernels and token inputs;
* :mod:`.patches` - the global patches active while tracing;
* :mod:`.traced_module` - :class:`TracedModule` and rebuilding a module around a graph.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import nn
from torch.fx import PH

from ...errors import SchedlangError, TraceError
from ...module_record import module_record
from .call_spec import CallSpec
from .common import _describe, _is_fake, module_device, _new_fake_mode, forward_parameters
from .core import SchedlangTracer, _Options

# also read by schedlang.primitives.trace and schedlang.distributed.pipeline, which trace whole models
from .examples import _shape_only_syncs  # noqa: F401
from .hf_bridge import EXAMPLE_BATCH, EXAMPLE_SEQUENCE, capture_call, example_config, fake_ids_forward, is_hf_model  # noqa: F401
from .leaf_policy import register_leaf_function
from .patches import _tracing_patches
from .specialization import check_specialized_arguments
from .training_mode import ModeDependentCall, TrainingModeGuard, guard_training_mode

# _rebuild_traced_module is imported here because pickles of traced modules name it by this path
from .traced_module import ModuleAttributes, TracedModule, _rebuild_traced_module, build_traced_module  # noqa: F401

__all__ = [
    "PH",
    "TracedModule",
    "ModuleAttributes",
    "SchedlangTracer",
    "CallSpec",
    "trace_module",
    "capture_call",
    "register_leaf_function",
    "check_specialized_arguments",
    "forward_parameters",
    "is_hf_model",
    "build_traced_module",
    "TrainingModeGuard",
    "ModeDependentCall",
]


def trace_module(module: nn.Module, *, path: str = "", recursive: bool = True, flatten: bool = False,
                 leaf_modules: Optional[Iterable[Any]] = None, concrete_args: Optional[Dict[str, Any]] = None,
                 call: Optional[Tuple[Tuple, Dict[str, Any]]] = None, fake_mode=None,
                 unlisted_are_inputs: bool = False) -> TracedModule:
    """Trace ``module`` into a :class:`TracedModule`; raise :class:`TraceError` on failure.

    ``path`` is used in messages and to resolve ``leaf_modules`` names (relative to
    ``module``). ``call`` is a recorded ``(args, kwargs)`` call (e.g. from
    :func:`capture_call`, values may be fake tensors); without it the signature policy and
    ``concrete_args`` decide the inputs. With ``unlisted_are_inputs`` (torch.fx's and Slapo's rule)
    and ``concrete_args`` given, every ``forward`` parameter not named in ``concrete_args`` is an
    input; a ``call`` then only supplies those inputs' example values. The module itself is not changed.

    Example::

        gm = trace_module(mlp, flatten=True)
        assert torch.equal(gm(x), mlp(x))
    """
    leaf_types, leaf_names = [], set()
    for item in leaf_modules or ():
        if isinstance(item, type):
            leaf_types.append(item)
        else:
            leaf_names.add(".".join(p for p in (path, item) if p))
    fake_mode = fake_mode or _new_fake_mode()
    options = _Options(recursive=recursive, flatten=flatten, leaf_types=tuple(leaf_types), leaf_names=leaf_names,
                       fake_mode=fake_mode)
    where = path or "<root>"
    if "forward" in module.__dict__ and not module_record(module).checkpointed:
        raise TraceError(f"{where}: {type(module).__name__} has a forward set on the instance, which FX cannot "
                         "trace; trace its parent with this module as a leaf instead")

    def make_example(t):
        if _is_fake(t):
            return t
        if t.device.type == "meta":  # an example from a plan: only its shape and dtype count
            device = module_device(module)
            with fake_mode:
                return torch.empty(t.shape, dtype=t.dtype, device="cpu" if device.type == "meta" else device)
        return fake_mode.from_tensor(t)

    def trace_once() -> TracedModule:
        tracer = SchedlangTracer(options, path=path)
        try:
            with _tracing_patches(module):
                if call is not None and not (unlisted_are_inputs and concrete_args is not None):
                    spec = CallSpec.from_call(module, call[0], call[1], lambda v: tracer._map_examples_safe(v))
                else:
                    spec = CallSpec.from_signature(module, concrete_args, make_example, unlisted_are_inputs,
                                                   _bound_arguments(module, call))
                gm, _ = tracer.trace_to_module(module, spec)
        except SchedlangError:
            raise
        except Exception as e:
            raise TraceError(f"{where}: cannot trace {type(module).__name__}: {_describe(e)}; keep the failing "
                             "submodule whole with leaf_modules=[...], or pass concrete_args") from e
        return gm

    gm = trace_once()
    # the graph is fixed to the mode it was traced in: make it follow the mode, or refuse the other mode
    guard_training_mode(module, gm, trace_once, where)
    return gm


def _bound_arguments(module: nn.Module, call: Optional[Tuple[Tuple, Dict[str, Any]]]) -> Dict[str, Any]:
    """The recorded call's values by parameter name (empty without a call, or when they do not bind)."""
    if call is None:
        return {}
    import inspect

    try:
        bound = inspect.Signature(forward_parameters(module)).bind(*call[0], **call[1])
    except TypeError:
        return {}
    return dict(bound.arguments)
