"""``compile_layers``: ``torch.compile`` each transformer layer of a built model, collectives kept eager or
opaque, with schedlang's Inductor passes where they apply; and the checks of ``torch.compile`` arguments that
``compile_layers`` and ``optimize_model`` share."""

from __future__ import annotations

import inspect
from typing import Dict, List

import torch
from torch import nn

from .. import compat
from ..errors import ArgumentTypeError, ScheduleTypeError, ScheduleValueError

__all__ = ["compile_layers", "LAYER_LISTS"]


#: names of the ModuleList holding the transformer layers, per family
LAYER_LISTS = ("layers", "h", "layer")


def compile_layers(model: nn.Module, trace_collectives: bool = False, fuse_projections: bool = False,
                   **compile_options) -> int:
    """``torch.compile`` the forward of every transformer layer of a built model; returns how many.

    The layer's *own* hooks (the sequence split in front of the first layer under sequence
    parallelism) stay outside, so every layer sees the same shapes and one compiled graph serves
    them all. With ``trace_collectives=False`` (default) the schedule's all-reduces (Megatron's
    forward and backward ones) stay inside the layer's graph as one opaque operator each
    (:mod:`schedlang.distributed.opaque_collectives`): a tensor-parallel layer compiles to one graph
    with no break, and the operator runs exactly the eager all-reduce. The other collectives (the
    gathers and reduce-scatters of sequence parallelism, the gradient sums of its norms, a user's
    own sync functions) run eagerly between compiled pieces, exactly as without compilation. With
    ``True`` every collective is traced into the layer graphs as torch's functional collectives,
    which the compiler may move to overlap with compute; this needs torch >= 2.13: on torch 2.11
    the traced graphs lose the backward all-reduce (gradients measured wrong on 2 H200s), so it is
    refused there.

    Each layer's tensor-parallel DTensors are swapped for their local tensors around the layer's
    call, outside the compiled code (:func:`schedlang.distributed.dtensor_params.hoist_local_views`).

    A layer with float8 Linears is compiled with the ``shared_amax`` joint-graph pass
    (:mod:`schedlang.graph.passes.shared_amax`): the backward reuses each activation's float8 scale
    from the forward instead of reading the activation again.

    ``fuse_projections=True`` compiles each layer with the ``shared_input_linears`` pre-grad pass
    (:mod:`schedlang.graph.passes.shared_input_linears`): the linears that read one input (q, k and v;
    gate and up) run as one GEMM on their weights concatenated per call; the parameters stay as they are.

    Example::

        model, opt = schedlang.build(sch, optimizer="adamw")
        compile_layers(model)
    """
    from ..distributed.dtensor_params import hoist_local_views
    from ..distributed.sequence_parallel import is_sequence_parallel_norm
    from ..distributed.shard_rules.norm import EAGER_COLLECTIVES_ATTR
    from ..distributed.sync_ops import OPAQUE_ATTR, SyncOp

    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"compile_layers: model must be the nn.Module that schedlang.build returns, got "
                                f"{type(model).__name__}; pass the model of model, opt = schedlang.build(sch)")
    _check_compile_options("compile_layers", compile_options, what="**compile_options")
    if trace_collectives and not compat.TRACED_COLLECTIVES_KEEP_BACKWARD:
        raise ScheduleValueError(
            f"compile_layers: trace_collectives=True needs torch >= 2.13 (this is {torch.__version__}): older "
            "compilers lose the backward all-reduce of traced collectives and the gradients are wrong; keep the "
            "default trace_collectives=False")
    count = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LAYER_LISTS and isinstance(module, nn.ModuleList):
            for layer in module:
                # tensor-parallel DTensors become local tensors around the layer's call, outside the compiled code
                hoist_local_views(layer)
                if not trace_collectives:
                    for sub in layer.modules():
                        _run_sync_hooks_eagerly(sub)
                        if isinstance(sub, SyncOp) and _opaque(sub):
                            sub.__dict__[OPAQUE_ATTR] = True  # one opaque operator inside the graph
                        elif isinstance(sub, SyncOp):
                            sub.forward = torch.compiler.disable(sub.forward)
                        elif is_sequence_parallel_norm(sub):
                            sub.__dict__[EAGER_COLLECTIVES_ATTR] = True  # the norm's arithmetic stays compiled
                layer.forward = torch.compile(layer.forward, **_with_passes(layer, compile_options, fuse_projections))
                count += 1
    if not count:
        raise ScheduleTypeError(f"compile_layers: no layer list ({', '.join(LAYER_LISTS)}) found in "
                                f"{type(model).__name__}; compile_layers needs a model that holds one of them")
    return count


def _with_passes(layer: nn.Module, compile_options: dict, fuse_projections: bool = False) -> dict:
    """The compile options for ``layer``, with schedlang's Inductor passes where they apply:

    * a layer with float8 Linears gets the ``shared_amax`` joint-graph pass (each activation's float8 scale
      is computed once, not again in the backward) and the ``shared_scaled_mm_operand`` post-grad pass (a
      float8 activation that q, k and v all read is written once, not once per matmul);
    * with ``fuse_projections``, the ``shared_input_linears`` pre-grad pass (linears on one input as one GEMM).

    A caller's own pass in the same place, or another backend than Inductor, is left as it is. A ``mode``
    given together with ``options`` (which torch.compile refuses) becomes the mode's options, spelled out,
    under the caller's."""
    from ..primitives.float8 import is_float8

    wanted = {}
    if any(is_float8(m) for m in layer.modules()):
        from ..graph.passes.shared_amax import SharedAmaxPass
        from ..graph.passes.shared_scaled_mm_operand import SharedScaledMMOperandPass

        wanted["joint_custom_post_pass"] = SharedAmaxPass()
        wanted["post_grad_custom_post_pass"] = SharedScaledMMOperandPass()
    if fuse_projections:
        from ..graph.passes.shared_input_linears import SharedInputLinearsPass

        wanted["pre_grad_custom_pass"] = SharedInputLinearsPass()
    options = dict(compile_options.get("options") or {})
    wanted = {k: v for k, v in wanted.items() if k not in options}
    mode = compile_options.get("mode")
    # any mode next to any options dict (even "default", even {}): torch.compile refuses each such pair
    both = compile_options.get("options") is not None and mode is not None
    if (not wanted and not both) or compile_options.get("backend", "inductor") != "inductor":
        return compile_options
    rest = {k: v for k, v in compile_options.items() if k not in ("mode", "options")}
    if mode not in (None, "default"):  # "default" has no options of its own
        # torch.compile takes a mode or options, not both: the mode's own options, spelled out
        options = {**torch._inductor.list_mode_options(mode, rest.get("dynamic")), **options}
    return {**rest, "options": {**options, **wanted}}


#: torch.compile's modes where torch._inductor cannot list them (it can on every torch schedlang supports)
_KNOWN_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile_modes() -> List[str]:
    try:
        from torch._inductor import list_mode_options

        return list(list_mode_options())
    except Exception:  # an Inductor that cannot list them
        return list(_KNOWN_COMPILE_MODES)


def _check_compile_options(where: str, compile_options: Dict, what: str = "compile_options") -> None:
    """Refuse ``torch.compile`` arguments that torch would refuse only when the first layer is compiled, by
    then after other changes: an unknown argument, an unknown ``mode`` or ``backend``, ``options`` that are not
    a dict, and ``mode`` with ``options`` where nothing can merge them (a backend other than Inductor; for
    Inductor :func:`_with_passes` spells the mode's options out)."""
    params = inspect.signature(torch.compile).parameters.values()
    valid = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)  # torch.compile wrapped (a test, a profiler)
    unknown = [k for k in compile_options if k not in valid]
    if unknown and not takes_any:
        raise ScheduleValueError(f"{where}: unknown torch.compile argument{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(map(repr, unknown))} in {what}; valid are torch.compile's keyword "
                                 f"arguments: {', '.join(valid)}")
    mode = compile_options.get("mode")
    if mode is not None:
        modes = _compile_modes()
        if not isinstance(mode, str) or mode not in modes:
            raise ScheduleValueError(f"{where}: invalid torch.compile mode {mode!r} in {what}: valid modes are "
                                     f"{', '.join(modes)}")
    options = compile_options.get("options")
    if options is not None and not isinstance(options, dict):
        raise ScheduleValueError(f"{where}: torch.compile's options in {what} must be a dict of Inductor settings "
                                 f"(e.g. {{'coordinate_descent_tuning': True}}), got {type(options).__name__}")
    backend = compile_options.get("backend", "inductor")
    if "backend" not in compile_options:
        pass  # torch.compile's own default, Inductor
    elif isinstance(backend, str):
        from torch._dynamo import list_backends

        if backend not in list_backends(exclude_tags=()):  # debugging and experimental backends too
            raise ScheduleValueError(f"{where}: invalid torch.compile backend {backend!r} in {what}: valid are a "
                                     f"callable or a registered name such as {', '.join(list_backends())}")
    elif not callable(backend):
        raise ScheduleValueError(f"{where}: torch.compile's backend in {what} must be a backend name or a callable, "
                                 f"got {type(backend).__name__}")
    if mode is not None and options is not None and backend != "inductor":
        raise ScheduleValueError(f"{where}: {what} name both a mode ({mode!r}) and options, which torch.compile "
                                 f"refuses for backend {backend!r} (only Inductor's mode options can be merged into "
                                 "them); give one of the two")


def _opaque(sync) -> bool:
    """A sync point whose collective a compiled graph can hold as one opaque operator: an all-reduce
    (forward or backward) of the schedule's own, over more than one rank."""
    from ..distributed.groups import world_size

    return sync.op == "all_reduce" and world_size(sync.group) > 1


def _run_sync_hooks_eagerly(module: nn.Module) -> None:
    """Keep the hooks that route a module's input or output through an eager sync point out of the
    compiled graph: the graph breaks there anyway, and the hook compiled as a frame of its own would,
    its argument structure differing from module to module (a tensor, a kwargs dict), exhaust
    torch.compile's recompile limit on a deep model. Hooks of opaque all-reduces stay in the graph."""
    from ..distributed.sync_ops import SyncHook, SyncOp

    for hooks in (module._forward_hooks, module._forward_pre_hooks):
        for key, hook in list(hooks.items()):
            if not isinstance(hook, SyncHook):
                continue
            sync = getattr(module, hook.child_name, None)
            if isinstance(sync, SyncOp) and _opaque(sync):
                continue
            hooks[key] = torch.compiler.disable(hook)
