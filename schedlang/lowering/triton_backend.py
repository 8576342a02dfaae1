"""``compiler="triton"``: generated Triton kernels for a subgraph's forward and backward.

The fused module specializes on the shapes and dtypes of its inputs (and on whether its
dropout modules are in training mode): the first call with a new signature translates
the subgraph (:mod:`~schedlang.lowering.translate`), generates the kernels
(:mod:`~schedlang.lowering.triton_codegen`), writes them to a Python file and imports it,
so ``inspect``, tracebacks and Triton's JIT see ordinary source. Kernels are cached by
their text; Triton caches the compiled binaries.

Autograd: a ``torch.autograd.Function`` saves only the inputs the backward kernel reads
(never intermediate values: the backward recomputes them) and the dropout seed.

Launch sizes come from a heuristic; on CUDA, for grids of at least 2**20 elements, a
handful of (BLOCK_R, BLOCK_N, num_warps) choices is timed once per kernel and shape and
the fastest is kept (``SCHEDLANG_AUTOTUNE=0`` turns that off).

Example::

    fused = lower_subgraph(gm, "triton", "BiasGeLU", example_inputs=[x, b])
    print(fused.source)      # the forward and backward kernels
    y = fused(x, b); y.sum().backward()
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading

import torch
import torch.fx
from torch import nn

from ..errors import LoweringError
from .fused_module import FusedSubgraph
from .translate import Specialization, specialize, unsupported_nodes, lowering_error
from .triton_codegen import backward_plan, forward_plan, module_source

__all__ = ["TritonFusedSubgraph", "lower"]

logger = logging.getLogger("schedlang.lowering.triton")

_MODULE_CACHE: dict[str, object] = {}
_TUNED: dict[tuple, tuple] = {}
_LOCK = threading.Lock()
_KERNEL_DIR = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def load_source(source: str, stem: str):
    """Import generated source from a file (Triton's JIT reads kernel source with ``inspect``)."""
    global _KERNEL_DIR
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    with _LOCK:
        module = _MODULE_CACHE.get(digest)
        if module is not None:
            return module
        if _KERNEL_DIR is None:
            _KERNEL_DIR = tempfile.mkdtemp(prefix="schedlang_kernels_")
        path = os.path.join(_KERNEL_DIR, f"{stem}_{digest}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"schedlang_generated.{stem}_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _MODULE_CACHE[digest] = module
        logger.debug("loaded generated kernels %s", path)
        return module


_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    count = _SM_COUNT.get(device.index)
    if count is None:
        count = _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _num_warps(elements: int) -> int:
    # about 16 elements per thread, between 4 and 16 warps
    return max(4, min(16, _next_pow2(max(1, elements // 512))))


def _candidates(plan, spec: Specialization) -> list[tuple[int, int, int]]:
    """(BLOCK_R, BLOCK_N, num_warps) choices: the heuristic first, then a few neighbours."""
    R, N = max(spec.n_rows, 1), max(spec.n_cols, 1)
    max_r = _next_pow2(R)
    if plan.whole_row:
        bn = _next_pow2(N)
        target = 4096 if bn <= 4096 else bn
        br = max(1, min(max_r, target // bn))
        first = (br, bn, _num_warps(br * bn))
        # 2 to 16 elements per thread and tile: a whole-row backward keeps about ten tiles
        # live (inputs, the prefetched next block, recomputed statistics), so more spills
        rest = [(r, bn, w) for r in (1, 2, 4, 8, 16) for w in (4, 8, 16)
                if r <= max_r and w * 64 <= max(r * bn, 256) and r * bn <= w * 512]
    else:
        bn = min(_next_pow2(N), 1024)
        br = max(1, min(max_r, 4096 // bn))
        first = (br, bn, _num_warps(br * bn))
        rest = [(r, c, w) for r, c, w in ((2, 1024, 4), (4, 1024, 4), (4, 1024, 8), (8, 1024, 8), (4, 2048, 8),
                                          (8, 512, 4))
                if c <= _next_pow2(N) and r <= max_r]
    out = [first]
    for cand in rest:
        if cand not in out:
            out.append(cand)
    return out


class _Kernel:
    """One generated kernel with its launch logic."""

    def __init__(self, plan, fn, spec: Specialization, interpret: bool):
        self.plan, self.fn, self.spec, self.interpret = plan, fn, spec, interpret
        self._chosen: dict = {}  # device -> (config, grid)

    def grid_and_programs(self, br: int, bn: int, device, warps: int = 4) -> tuple:
        row_blocks = -(-self.spec.n_rows // br)
        col_blocks = 1 if self.plan.whole_row else -(-self.spec.n_cols // bn)
        if self.plan.persistent:
            # as many programs as the GPU holds at once (64 warps per multiprocessor), so
            # that loads of many programs are in flight; but at most one program per 16
            # rows, which keeps the partial sums (one row of n_cols per program, written
            # and summed again) to a few percent of the traffic
            if device.type == "cuda":
                cap = _sm_count(device) * max(1, 64 // warps)
            else:
                cap = 8
            row_blocks = min(row_blocks, max(1, cap // col_blocks), max(1, self.spec.n_rows // 16))
        return (row_blocks, col_blocks)

    def launch(self, build_args, device):
        """``build_args(grid)`` returns (positional args, post-processing callback)."""
        chosen = self._chosen.get(device)
        if chosen is None:
            config = self._choose(build_args, device)
            chosen = self._chosen[device] = (config, self.grid_and_programs(config[0], config[1], device, config[2]))
        (br, bn, warps), grid = chosen
        args, finish = build_args(grid)
        if self.interpret:
            self._launch_interpreted(grid, args, br, bn, warps)
        else:
            self.fn[grid](*args, BLOCK_R=br, BLOCK_N=bn, num_warps=warps)
        return finish()

    def _launch_interpreted(self, grid, args, br, bn, warps):
        import numpy as np

        # padded lanes may divide 0 by 0 in numpy; they are masked out of every result
        with np.errstate(all="ignore"):
            self.fn[grid](*args, BLOCK_R=br, BLOCK_N=bn, num_warps=warps)

    def _run(self, build_args, config, device):
        br, bn, warps = config
        grid = self.grid_and_programs(br, bn, device, warps)
        args, finish = build_args(grid)
        if self.interpret:
            import numpy as np

            # padded lanes may divide 0 by 0 in numpy; they are masked out of every result
            with np.errstate(all="ignore"):
                self.fn[grid](*args, BLOCK_R=br, BLOCK_N=bn, num_warps=warps)
        else:
            self.fn[grid](*args, BLOCK_R=br, BLOCK_N=bn, num_warps=warps)
        return finish()

    def _choose(self, build_args, device):
        candidates = _candidates(self.plan, self.spec)
        size = self.spec.n_rows * self.spec.n_cols
        if (device.type != "cuda" or self.interpret or len(candidates) == 1 or size < 2 ** 20
                or os.environ.get("SCHEDLANG_AUTOTUNE", "1") == "0"):
            return candidates[0]
        key = (self.plan.kernel_name, id(self.fn), self.spec.n_rows, self.spec.n_cols, device.index)
        choice = _TUNED.get(key)
        if choice is None:
            from triton.testing import do_bench

            timings = {}
            for cand in candidates:
                try:
                    timings[cand] = do_bench(lambda: self._run(build_args, cand, device), warmup=5, rep=20,
                                             return_mode="median")
                except Exception as exc:  # a configuration that does not compile (resources)
                    logger.debug("config %s of %s failed: %s", cand, self.plan.kernel_name, exc)
            choice = min(timings, key=timings.get) if timings else candidates[0]
            _TUNED[key] = choice
            logger.info("%s at %dx%d: BLOCK_R=%d BLOCK_N=%d num_warps=%d (%.4f ms)", self.plan.kernel_name,
                        self.spec.n_rows, self.spec.n_cols, *choice, timings.get(choice, float("nan")))
        return choice


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
        self._forward_reads = [(position[id(inp)], inp.kind, inp.expand) for inp in self.forward_plan.inputs]
        self._saved: dict = {}

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
        spec, plan = self.spec, self.forward_plan
        device = tensors[0].device if tensors else torch.device("cpu")
        outs = [torch.empty(o.shape, dtype=o.dtype, device=device) for o in spec.outputs]
        if spec.n_rows * spec.n_cols == 0:
            return outs

        def build(grid):
            args = []
            for k, kind, expand in self._forward_reads:
                t = _prepare(kind, expand, tensors[k], spec, self.index64)
                args.append(t)
                if kind == "full" or kind == "row":
                    args.append(t.stride(0))
            args.extend(outs)
            args.extend([spec.n_rows, spec.n_cols])
            if plan.uses_seed:
                args.append(seed)
            return args, lambda: outs

        return self._kernel(plan).launch(build, device)

    # ---------------------------------------------------------------- backward
    def backward(self, saved: dict, grad_outputs, needs: tuple, seed: int):
        """Gradients of every input (None where not needed). ``saved`` maps input
        positions to tensors; ``grad_outputs`` may hold None (no gradient)."""
        spec = self.spec
        present = tuple(g is not None for g in grad_outputs)
        grads = [None] * len(spec.inputs)
        if not any(present) or not any(needs):
            return grads
        plan = self.backward_plan_for(needs, present)
        device = next(g for g in grad_outputs if g is not None).device
        if spec.n_rows * spec.n_cols == 0 or not plan.sinks:
            for k, (inp, need) in enumerate(zip(spec.inputs, needs)):
                if need:
                    grads[k] = torch.zeros(inp.shape, dtype=inp.dtype, device=device)
            return grads
        position = {id(inp): k for k, inp in enumerate(spec.inputs)}
        R, N = spec.n_rows, spec.n_cols

        def build(grid):
            args = []
            for inp in plan.inputs:
                t = _prepare(inp.kind, inp.expand, saved[position[id(inp)]], spec, self.index64)
                args.append(t)
                if inp.kind in ("full", "row"):
                    args.append(t.stride(0))
            for out, gv, _ in plan.grad_outputs:
                kind = _kind(gv)
                g = _prepare(kind, False, grad_outputs[gv.attr("index")], spec, self.index64)
                args.append(g)
                if kind in ("full", "row"):
                    args.append(g.stride(0))
            buffers = []
            programs = grid[0] * grid[1]
            for sink in plan.sinks:
                if sink.role == "grad":
                    shape = (R, N) if sink.kind == "full" else (R,)
                    buf = torch.empty(shape, dtype=sink.dtype, device=device)
                elif sink.role == "col_partial":
                    buf = torch.empty((grid[0], N), dtype=sink.dtype, device=device)
                else:
                    buf = torch.empty((programs,), dtype=sink.dtype, device=device)
                buffers.append(buf)
                args.append(buf)
            args.extend([R, N])
            if plan.uses_seed:
                args.append(seed)

            def finish():
                for sink, buf in zip(plan.sinks, buffers):
                    inp = spec.inputs[sink.index]
                    if sink.role == "grad":
                        if inp.expand:  # sum over the dimensions the input was broadcast along
                            grad = buf.view(spec.full_shape).sum_to_size(inp.shape).to(inp.dtype)
                        else:
                            grad = buf.view(inp.shape)
                    elif sink.role == "col_partial":
                        grad = buf.sum(0).to(inp.dtype).view(inp.shape)
                    else:
                        grad = buf.sum().to(inp.dtype).view(inp.shape)
                    grads[sink.index] = grad
                for k, other in plan.grad_aliases.items():
                    grads[k] = grads[other]
                return grads

            return args, finish

        self._kernel(plan).launch(build, device)
        for k, (inp, need) in enumerate(zip(spec.inputs, needs)):
            if need and grads[k] is None and inp.dtype.is_floating_point:
                grads[k] = torch.zeros(inp.shape, dtype=inp.dtype, device=device)
        return grads


class _FusedFunction(torch.autograd.Function):
    """Autograd node of a fused subgraph: the generated backward kernel is its backward."""

    @staticmethod
    def forward(ctx, compiled: CompiledSubgraph, seed: int, *tensors):
        outs = compiled.forward(tensors, seed)
        needs = tuple(ctx.needs_input_grad[2:])
        saved_positions = compiled.saved_input_indices(needs)
        ctx.compiled, ctx.seed, ctx.needs = compiled, seed, needs
        ctx.saved_positions = saved_positions
        ctx.save_for_backward(*[tensors[k] for k in saved_positions])
        ctx.set_materialize_grads(False)
        non_diff = [o for o, spec in zip(outs, compiled.spec.outputs) if spec.dtype == torch.bool]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = dict(zip(ctx.saved_positions, ctx.saved_tensors))
        grads = ctx.compiled.backward(saved, grad_outputs, ctx.needs, ctx.seed)
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
            clone.__dict__[key] = value if shared else copy.deepcopy(value, memo)
        return clone

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_compiled"], state["_latest"] = {}, None
        return state

    def _attr_tensors(self):
        for q in self._attr_names:
            t = self._fetch(q)
            if isinstance(t, torch.Tensor):
                yield t

    def _fetch(self, qualname: str):
        obj = self
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

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
        self._check_arity(args)
        for k, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                from ..errors import ScheduleTypeError

                raise ScheduleTypeError(f"{self.name}: input {self.input_names[k]!r} is a {type(a).__name__}; "
                                        "the triton compiler takes tensors only")
        compiled = self.specialize([(a.shape, a.dtype) for a in args], args[0].device if args else None)
        # kernel inputs in spec order: arguments by position, then attributes as met
        ordered = [args[inp.source[1]] if inp.source[0] == "arg" else self._fetch(inp.source[1])
                   for inp in compiled.spec.inputs]
        self._check_devices(ordered, compiled.interpret)
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item()) if compiled.uses_dropout else 0
        if torch.is_grad_enabled() and any(t.requires_grad for t in ordered):
            outs = _FusedFunction.apply(compiled, seed, *ordered)
        else:
            outs = compiled.forward(ordered, seed)
        return outs[0] if compiled.spec.single_output else tuple(outs)

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
