"""``compiler="triton"``: generated Triton kernels for a subgraph's forward and backward.

The fused module specializes on the shapes and dtypes of its inputs (and on whether its
dropout modules are in training mode): the first call with a new signature translates
the subgraph (:mod:`~schedlang.lowering.translate`), generates the kernels
(:mod:`~schedlang.lowering.triton_codegen`), writes them to a Python file and imports it
(:mod:`~schedlang.lowering.kernel_files`; the files are removed at exit), so ``inspect``,
tracebacks and Triton's JIT see ordinary source. Kernels are cached by
their text; Triton caches the compiled binaries.

Autograd: a ``torch.autograd.Function`` saves only the inputs the backward kernel reads
(never intermediate values: the backward recomputes them) and the dropout seed.

Launch sizes come from a heuristic; on CUDA, for grids of at least 2**20 elements, a
handful of (BLOCK_R, BLOCK_N, num_warps) choices is timed once per kernel and shape and
the fastest is kept (``SCHEDLANG_AUTOTUNE=0`` turns that off).

Per-call host work is kept small, since for a fused pointwise op it can exceed the GPU time:
a call looks up its specialization by the shapes, dtypes and devices of its inputs (one
dict lookup), passes contiguous tensors to the kernels as they are, reduces the column
partial sums of all bias-like gradients with one sum, and on CUDA launches the binary that
Triton's JIT returned for the first call with the same specialization directly
(``SCHEDLANG_DIRECT_LAUNCH=0`` goes through the JIT at every call).

Example::

    fused = lower_subgraph(gm, "triton", "BiasGeLU", example_inputs=[x, b])
    print(fused.source)      # the forward and backward kernels
    y = fused(x, b); y.sum().backward()
"""

from __future__ import annotations

import logging
import operator
import os

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import LoweringError
from .fused_module import FusedSubgraph
from .kernel_files import load_source
from .translate import Specialization, fetch_attr, lowering_error, specialize, unsupported_nodes
from .triton_codegen import backward_plan, forward_plan, module_source
from .triton_launch import _TUNED, _Kernel  # noqa: F401  (_TUNED: read by the benchmarks)

__all__ = ["TritonFusedSubgraph", "lower"]

logger = logging.getLogger("schedlang.lowering.triton")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _host_mode(tensors) -> tuple:
    """What a call off CUDA depends on besides shapes and dtypes."""
    return (_interpreting(),) + tuple(t.device.type for t in tensors)


def _prepare(inp_kind: str, expand: bool, t: torch.Tensor, spec: Specialization, index64: bool) -> torch.Tensor:
    """A 2-D (rows, n_cols) / 1-D view of ``t`` that the kernels can index."""
    R, N = spec.n_rows, spec.n_cols
    if expand:
        return t.expand(spec.full_shape).reshape(R, N).contiguous()
    if inp_kind == "full":
        v = t.reshape(R, N)
        if (N > 1 and v.stride(1) != 1) or (not index64 and R * abs(v.stride(0)) >= 2 ** 31 - 1):
            v = v.contiguous()
        return v
    if inp_kind == "row":
        v = t.reshape(R)
        return v if index64 or R * abs(v.stride(0)) < 2 ** 31 - 1 else v.contiguous()
    if inp_kind == "col":
        return t.reshape(N).contiguous()
    return t.reshape(1)


def _kind(v) -> str:
    return {(True, True): "full", (True, False): "row", (False, True): "col", (False, False): "scalar"}[
        (v.rows, v.cols)]


def _read(kind: str, expand: bool, spec: Specialization) -> tuple:
    """(kind, expand, row stride of the tensor when it is contiguous or None when the kernel
    takes no row stride): a contiguous tensor is passed as it is (the kernel only sees its
    address), with the row stride its (rows, n_cols) view would have."""
    stride = spec.n_cols if kind == "full" else 1 if kind == "row" else None
    return kind, expand, stride


def _append_reads(args: list, reads, tensors, spec: Specialization, index64: bool):
    """Append each tensor ``tensors[slot]`` of ``reads = [(slot, kind, expand, stride)]``
    (and its row stride) to ``args``; only non-contiguous or broadcast ones are reshaped."""
    for slot, kind, expand, stride in reads:
        t = tensors[slot]
        if expand or not t.is_contiguous():
            t = _prepare(kind, expand, t, spec, index64)
            if stride is not None:
                stride = t.stride(0)
        args.append(t)
        if stride is not None:
            args.append(stride)


class _BackwardLaunch:
    """What one backward kernel reads and writes, resolved once per (inputs needing a
    gradient, outputs receiving one)."""

    def __init__(self, compiled: "CompiledSubgraph", plan, needs: tuple, saved_positions: list):
        spec = compiled.spec
        self.plan = plan
        slot = {k: j for j, k in enumerate(saved_positions)}
        position = {id(inp): k for k, inp in enumerate(spec.inputs)}
        self.reads = [(slot[position[id(inp)]],) + _read(inp.kind, inp.expand, spec) for inp in plan.inputs]
        self.grad_reads = [(gv.attr("index"),) + _read(_kind(gv), False, spec) for _, gv, _ in plan.grad_outputs]
        R, N = spec.n_rows, spec.n_cols
        # (role, buffer shape or None when it depends on the grid, buffer dtype, input position,
        #  input shape, input dtype, whether the input was broadcast)
        self.sinks = []
        for sink in plan.sinks:
            inp = spec.inputs[sink.index]
            shape = tuple(inp.shape)
            if sink.role == "grad":
                buffer = ((R, N) if sink.kind == "full" else (R,)) if inp.expand else shape
            else:
                buffer = None
            self.sinks.append((sink.role, buffer, sink.dtype, sink.index, shape, inp.dtype, inp.expand))
        # column partials of several inputs with the same dtypes (a LayerNorm's weight and
        # bias, the bias before it) share one (inputs, programs, n_cols) buffer, reduced by
        # one sum and cast once: two small launches instead of two per input
        groups: dict = {}
        for j, (role, _, dtype, _, _, inp_dtype, _) in enumerate(self.sinks):
            if role == "col_partial":
                groups.setdefault((dtype, inp_dtype), []).append(j)
        self.col_groups = [(members, dtype, inp_dtype) for (dtype, inp_dtype), members in groups.items()
                           if len(members) > 1]
        grouped = {j for members, _, _ in self.col_groups for j in members}
        self.sinks = [("grouped",) + sink[1:] if j in grouped else sink for j, sink in enumerate(self.sinks)]
        self.aliases = list(plan.grad_aliases.items())
        given = {s.index for s in plan.sinks} | set(plan.grad_aliases)
        self.zeros = [(k, tuple(inp.shape), inp.dtype) for k, (inp, need) in enumerate(zip(spec.inputs, needs))
                      if need and k not in given and inp.dtype.is_floating_point]
        self.sizes = [R, N]
        self.kernel = compiled._kernel(plan)


class CompiledSubgraph:
    """The kernels of one specialization (one set of input shapes and dtypes)."""

    def __init__(self, spec: Specialization, interpret: bool):
        self.spec = spec
        self.interpret = interpret
        self.forward_plan = forward_plan(spec)
        self.index64 = spec.n_rows * max(spec.n_cols, 1) >= 2 ** 31 - 1
        all_needs = tuple(inp.dtype.is_floating_point for inp in spec.inputs)
        all_present = tuple(True for _ in spec.outputs)
        self._backward_plans = {(all_needs, all_present): backward_plan(spec, all_needs, all_present)}
        self.default_backward_key = (all_needs, all_present)
        self._kernels: dict = {}
        self.uses_dropout = bool(spec.dropout_ps)
        position = {id(inp): k for k, inp in enumerate(spec.inputs)}
        self._forward_reads = [(position[id(inp)],) + _read(inp.kind, inp.expand, spec)
                               for inp in self.forward_plan.inputs]
        self._outputs = [(tuple(o.shape), o.dtype) for o in spec.outputs]
        self._sizes = [spec.n_rows, spec.n_cols]
        self._empty = spec.n_rows * spec.n_cols == 0
        self.bool_outputs = [k for k, o in enumerate(spec.outputs) if o.dtype == torch.bool]
        self._saved: dict = {}
        self._backward_launches: dict = {}

    # ---------------------------------------------------------------- source
    @property
    def source(self) -> str:
        plans = [self.forward_plan, self._backward_plans[self.default_backward_key]]
        return module_source(self.spec, plans, self.interpret)

    def backward_plan_for(self, needs: tuple, present: tuple):
        key = (needs, present)
        plan = self._backward_plans.get(key)
        if plan is None:
            tag = f"_v{len(self._backward_plans)}"
            plan = self._backward_plans[key] = backward_plan(self.spec, needs, present, tag)
        return plan

    def saved_input_indices(self, needs: tuple) -> list[int]:
        """Positions (in ``spec.inputs``) of the inputs the backward kernel reads."""
        saved = self._saved.get(needs)
        if saved is None:
            plan = self.backward_plan_for(needs, tuple(True for _ in self.spec.outputs))
            used = {id(inp) for inp in plan.inputs}
            saved = self._saved[needs] = [k for k, inp in enumerate(self.spec.inputs) if id(inp) in used]
        return saved

    def _kernel(self, plan) -> _Kernel:
        kernel = self._kernels.get(id(plan))
        if kernel is None:
            if plan is self.forward_plan or plan is self._backward_plans[self.default_backward_key]:
                plans = [self.forward_plan, self._backward_plans[self.default_backward_key]]
            else:
                plans = [plan]
            module = load_source(module_source(self.spec, plans, self.interpret), plan.kernel_name)
            kernel = self._kernels[id(plan)] = _Kernel(plan, getattr(module, plan.kernel_name), self.spec,
                                                       self.interpret)
        return kernel

    # ---------------------------------------------------------------- forward
    def forward(self, tensors, seed: int):
        device = tensors[0].device if tensors else torch.device("cpu")
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._outputs]
        if self._empty:
            return outs
        kernel = self._kernels.get(id(self.forward_plan)) or self._kernel(self.forward_plan)
        chosen = kernel._chosen.get(device)
        if chosen is None:
            chosen = kernel.chosen(lambda grid: (self._forward_args(tensors, outs, seed), lambda: outs), device)
        config, grid = chosen
        kernel.call(grid, self._forward_args(tensors, outs, seed), config)
        return outs

    def _forward_args(self, tensors, outs, seed: int) -> list:
        return self._kernel_args(((self._forward_reads, tensors),), outs, self._sizes, self.forward_plan, seed)

    def _kernel_args(self, reads, written, sizes, plan, seed: int) -> list:
        """A kernel's positional arguments: for each ``(reads, tensors)`` of ``reads`` the tensors
        read (with their row strides), then the tensors ``written``, the ``sizes`` and the seed."""
        args = []
        for which, tensors in reads:
            _append_reads(args, which, tensors, self.spec, self.index64)
        args += written
        args += sizes
        if plan.uses_seed:
            args.append(seed)
        return args

    # ---------------------------------------------------------------- backward
    def backward(self, saved, grad_outputs, needs: tuple, seed: int):
        """Gradients of every input (None where not needed). ``saved`` holds the inputs at
        ``saved_input_indices(needs)``; ``grad_outputs`` may hold None (no gradient)."""
        present = tuple(g is not None for g in grad_outputs)
        launch = self._backward_launches.get((needs, present))
        if launch is None:
            if not any(present) or not any(needs):
                return [None] * len(self.spec.inputs)
            plan = self.backward_plan_for(needs, present)
            if self._empty or not plan.sinks:
                launch = None
            else:
                launch = self._backward_launches[(needs, present)] = _BackwardLaunch(
                    self, plan, needs, self.saved_input_indices(needs))
        device = next(g for g in grad_outputs if g is not None).device
        if launch is None:  # nothing to compute: zeros
            return [torch.zeros(inp.shape, dtype=inp.dtype, device=device) if need else None
                    for inp, need in zip(self.spec.inputs, needs)]
        kernel = launch.kernel
        chosen = kernel._chosen.get(device)
        if chosen is None:
            def build(grid):
                buffers = self._backward_buffers(launch, grid, device)
                args = self._backward_args(launch, saved, grad_outputs, buffers[0], seed)
                return args, lambda: self._backward_finish(launch, buffers, device)

            chosen = kernel.chosen(build, device)
        config, grid = chosen
        buffers = self._backward_buffers(launch, grid, device)
        kernel.call(grid, self._backward_args(launch, saved, grad_outputs, buffers[0], seed), config)
        return self._backward_finish(launch, buffers, device)

    def _backward_buffers(self, launch: _BackwardLaunch, grid, device) -> tuple:
        """(one buffer per sink, in sink order; the shared buffer of each column group)."""
        buffers = []
        for role, shape, dtype, _, inp_shape, _, _ in launch.sinks:
            if role == "col_partial":  # one row of column sums per program
                buffers.append(torch.empty((grid[0],) + inp_shape, dtype=dtype, device=device))
            elif role == "scalar_partial":
                buffers.append(torch.empty((grid[0] * grid[1],), dtype=dtype, device=device))
            elif role == "grad":
                buffers.append(torch.empty(shape, dtype=dtype, device=device))
            else:  # grouped: filled below
                buffers.append(None)
        shared = []
        for members, dtype, _ in launch.col_groups:
            group = torch.empty((len(members), grid[0], self.spec.n_cols), dtype=dtype, device=device)
            shared.append(group)
            for j, part in zip(members, group.unbind(0)):
                buffers[j] = part
        return buffers, shared

    def _backward_args(self, launch: _BackwardLaunch, saved, grad_outputs, sink_buffers, seed: int) -> list:
        return self._kernel_args(((launch.reads, saved), (launch.grad_reads, grad_outputs)), sink_buffers,
                                 launch.sizes, launch.plan, seed)

    def _backward_finish(self, launch: _BackwardLaunch, buffers, device) -> list:
        buffers, shared = buffers
        grads = [None] * len(self.spec.inputs)
        for (role, _, dtype, index, inp_shape, inp_dtype, expand), buf in zip(launch.sinks, buffers):
            if role == "grouped":
                continue
            if role == "grad":
                if expand:  # sum over the dimensions the input was broadcast along
                    buf = buf.view(self.spec.full_shape).sum_to_size(inp_shape)
            elif role == "col_partial":  # the buffer is (programs, *input shape)
                buf = buf.sum(0)
            else:
                buf = buf.sum()
                if inp_shape != ():
                    buf = buf.view(inp_shape)
            grads[index] = buf if dtype == inp_dtype else buf.to(inp_dtype)
        for (members, dtype, inp_dtype), group in zip(launch.col_groups, shared):
            total = group.sum(1)  # (inputs, n_cols)
            if dtype != inp_dtype:
                total = total.to(inp_dtype)
            for j, grad in zip(members, total.unbind(0)):
                _, _, _, index, inp_shape, _, _ = launch.sinks[j]
                grads[index] = grad if len(inp_shape) == 1 else grad.view(inp_shape)
        for k, other in launch.aliases:
            grads[k] = grads[other]
        for k, shape, dtype in launch.zeros:
            grads[k] = torch.zeros(shape, dtype=dtype, device=device)
        return grads


class _FusedFunction(torch.autograd.Function):
    """Autograd node of a fused subgraph: the generated backward kernel is its backward."""

    @staticmethod
    def forward(ctx, compiled: CompiledSubgraph, seed: int, *tensors):
        outs = compiled.forward(tensors, seed)
        needs = ctx.needs_input_grad[2:]
        ctx.compiled, ctx.seed, ctx.needs = compiled, seed, needs
        ctx.save_for_backward(*[tensors[k] for k in compiled.saved_input_indices(needs)])
        ctx.set_materialize_grads(False)
        if compiled.bool_outputs:
            ctx.mark_non_differentiable(*[outs[k] for k in compiled.bool_outputs])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = ctx.compiled.backward(ctx.saved_tensors, grad_outputs, ctx.needs, ctx.seed)
        return (None, None, *grads)


class TritonFusedSubgraph(FusedSubgraph):
    """A subgraph run by generated Triton kernels (forward and backward).

    ``source`` holds the generated code of the latest specialization; ``specializations``
    lists the shapes seen so far.
    """

    compiler = "triton"

    def __init__(self, gm: torch.fx.GraphModule, name: str):
        super().__init__(gm, name)
        self.__dict__["_compiled"] = {}
        self.__dict__["_latest"] = None
        self._dropout_modules = [n.target for n in gm.graph.nodes
                                 if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Dropout)]
        attr_names = []
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                attr_names.append(node.target)
            elif node.op == "call_module":
                mod = gm.get_submodule(node.target)
                attr_names += [f"{node.target}.{p}" for p, _ in mod.named_parameters(recurse=False)]
        self._attr_names = attr_names

    def __deepcopy__(self, memo):
        # specializations (generated kernels) are immutable and shared by copies
        import copy

        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            shared = key in ("_compiled", "_latest")
            if key == "_calls":  # rebuilt at the next call
                continue
            clone.__dict__[key] = value if shared else copy.deepcopy(value, memo)
        return clone

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_compiled"], state["_latest"] = {}, None
        state.pop("_calls", None)
        return state

    def _attr_tensors(self):
        for q in self._attr_names:
            t = self._fetch(q)
            if isinstance(t, torch.Tensor):
                yield t

    def _fetch(self, qualname: str):
        return fetch_attr(self, qualname)

    def specialize(self, metas, device=None) -> CompiledSubgraph:
        """Generate (or fetch) the kernels for inputs of the given ``(shape, dtype)`` pairs
        on ``device`` (default: where the subgraph's parameters are, else the CPU)."""
        if device is None:
            device = next((t.device for t in self._attr_tensors()), torch.device("cpu"))
        attr_key = tuple((q, t.shape, t.dtype) for q in self._attr_names
                         for t in [self._fetch(q)] if isinstance(t, torch.Tensor)) if self._attr_names else ()
        dropout_key = tuple(self.get_submodule(t).training for t in self._dropout_modules)
        interpret = _interpreting()
        key = (tuple((tuple(shape), dtype) for shape, dtype in metas), attr_key, dropout_key, interpret, device.type)
        compiled = self._compiled.get(key)
        if compiled is None:
            spec = specialize(self.graph_module, self, metas, self.name, device)
            compiled = self._compiled[key] = CompiledSubgraph(spec, interpret)
            logger.debug("%s: specialized for %s", self.name, metas)
        self.__dict__["_latest"] = compiled
        return compiled

    @property
    def source(self) -> str:
        """The generated Triton code (forward and backward kernels) of the latest specialization."""
        if self._latest is None:
            return (f"# '{self.name}': kernels are generated for the input shapes at the first call "
                    "(or pass example_inputs to lower_subgraph); the subgraph:\n" + self.graph_module.code)
        return self._latest.source

    @property
    def specializations(self) -> list:
        return [key[0] for key in self._compiled]

    def forward(self, *args):
        if args and isinstance(args[0], FakeTensor):
            # only shapes are asked for (tracing, example values): the subgraph's own ops answer them
            return self.graph_module(*args)
        calls, attr_getters, dropout_getters = self.__dict__.get("_calls") or self._call_state()
        inputs = args + tuple([get(self) for get in attr_getters]) if attr_getters else args
        # the call key: what the specialization and the device checks depend on
        try:
            key = [(t.shape, t.dtype, t.get_device()) for t in inputs]
        except AttributeError:  # not a tensor: the checks below raise
            hit = key = None
        else:
            if dropout_getters:
                key += [get(self).training for get in dropout_getters]
            key.append(len(args))
            key = tuple(key)
            hit = calls.get(key)
            # off CUDA (device index -1) the entry also depends on the device types and on
            # whether the kernels are interpreted (TRITON_INTERPRET may change between calls)
            if hit is not None and hit[2] is not None and hit[2] != _host_mode(inputs):
                hit = None
        if hit is None:
            compiled, order = self._first_call(args)
            pick = None
            if key is not None and order is not None:
                pick = operator.itemgetter(*order) if len(order) > 1 else (
                    lambda seq, k=(order or [None])[0]: () if k is None else (seq[k],))
                on_cuda = all(t.get_device() >= 0 for t in inputs)
                calls[key] = (compiled, pick, None if on_cuda else _host_mode(inputs))
        else:
            compiled, pick, _ = hit
            self.__dict__["_latest"] = compiled
        # kernel inputs in spec order: arguments by position, then attributes as met
        ordered = pick(inputs) if pick is not None else self._ordered(compiled, args)
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item()) if compiled.uses_dropout else 0
        if torch.is_grad_enabled() and any(t.requires_grad for t in ordered):
            outs = _FusedFunction.apply(compiled, seed, *ordered)
        else:
            outs = compiled.forward(ordered, seed)
        return outs[0] if compiled.spec.single_output else tuple(outs)

    def _call_state(self) -> tuple:
        """(call cache, attribute getters, dropout module getters); the call cache maps the
        shapes, dtypes and devices of the inputs and attributes (and the dropout modes) to
        the specialization and a getter of its kernel inputs from ``args + attributes``."""
        state = ({}, [operator.attrgetter(q) for q in self._attr_names],
                 [operator.attrgetter(t) for t in self._dropout_modules])
        self.__dict__["_calls"] = state
        return state

    def _first_call(self, args) -> tuple:
        """Checks and specialization for a new call key: (compiled, positions of the kernel
        inputs in ``args + attributes``, or None when they cannot be cached)."""
        self._check_arity(args)
        for k, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                from ..errors import ScheduleTypeError

                raise ScheduleTypeError(f"{self.name}: input {self.input_names[k]!r} is a {type(a).__name__}; "
                                        "the triton compiler takes tensors only")
        compiled = self.specialize([(a.shape, a.dtype) for a in args], args[0].device if args else None)
        self._check_devices(self._ordered(compiled, args), compiled.interpret)
        order = []
        for inp in compiled.spec.inputs:
            if inp.source[0] == "arg":
                order.append(inp.source[1])
            elif inp.source[1] in self._attr_names:
                order.append(len(args) + self._attr_names.index(inp.source[1]))
            else:
                return compiled, None
        return compiled, order

    def _ordered(self, compiled: CompiledSubgraph, args) -> list:
        return [args[inp.source[1]] if inp.source[0] == "arg" else self._fetch(inp.source[1])
                for inp in compiled.spec.inputs]

    def _check_devices(self, tensors, interpret: bool):
        first = tensors[0].device if tensors else None
        if first is not None and first.type == "cuda" and all(t.device == first for t in tensors):
            return
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise LoweringError(f"{self.name}: inputs are on several devices {sorted(map(str, devices))}; "
                                "the fused kernels need them on one")
        device = next(iter(devices), torch.device("cpu"))
        if device.type != "cuda" and not interpret:
            raise LoweringError(
                f"{self.name}: compiler='triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1), "
                f"got tensors on {device}; use compiler='inductor' or compiler='eager' on this device")


def check_lowerable(gm: torch.fx.GraphModule, name: str):
    """Raise :class:`LoweringError` for every op of ``gm`` without a Triton lowering."""
    problems = unsupported_nodes(gm)
    if problems:
        raise lowering_error(name, problems, gm)


def lower(gm: torch.fx.GraphModule, name: str, example_inputs=None) -> TritonFusedSubgraph:
    check_lowerable(gm, name)
    fused = TritonFusedSubgraph(gm, name)
    metas = _example_metas(gm, example_inputs)
    if metas is not None:
        device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), None) \
            if example_inputs is not None else None
        fused.specialize(metas, device)  # surfaces shape-dependent errors now and makes `source` available
    return fused


def _example_metas(gm, example_inputs):
    if example_inputs is not None:
        return [(tuple(t.shape), t.dtype) for t in example_inputs]
    metas = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val", node.meta.get("example_value"))
        tm = node.meta.get("tensor_meta")
        if isinstance(val, torch.Tensor):
            shape, dtype = tuple(val.shape), val.dtype
        elif tm is not None and hasattr(tm, "shape") and hasattr(tm, "dtype"):
            shape, dtype = tuple(tm.shape), tm.dtype
        else:
            return None
        if not all(type(s) is int for s in shape):  # symbolic sizes: wait for real inputs
            return None
        metas.append((shape, dtype))
    return metas
