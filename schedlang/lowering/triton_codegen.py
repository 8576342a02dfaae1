"""Triton source for the forward and backward kernels of a specialized subgraph.

A kernel works on tiles of ``BLOCK_R`` rows by ``BLOCK_N`` columns of the ``rows x n_cols``
grid (leading dimensions flattened into rows). Values keep their natural tile shape:
``[BLOCK_R, BLOCK_N]`` for full values, ``[BLOCK_R, 1]`` for row values, ``[1, BLOCK_N]`` for
column values (a bias, loaded once per program), ``[1, 1]`` for scalars; Triton's
broadcasting does the rest.

Three launch shapes:

* **tiled** (pointwise subgraphs): a 2-D grid of row blocks by column blocks;
* **whole-row** (the subgraph or its derivative reduces over the last dimension): one
  column block holding the whole row (``BLOCK_N >= n_cols``), so row sums stay in registers;
* **persistent** (backward kernels with gradients of broadcast inputs, e.g. a bias): a
  capped number of programs loops over row blocks, accumulates its column sums in
  registers and writes one partial row; the host sums the partials (a tiny tensor).

Padded lanes (``cols >= n_cols``) are excluded from every reduction with ``tl.where``.

Example::

    plan = forward_plan(spec)
    source = module_source(spec, [plan], interpret=True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .autodiff import derive_gradients
from .ir import Value
from .ir_ops import IR_OPS
from .translate import Specialization

__all__ = ["KernelPlan", "Sink", "forward_plan", "backward_plan", "module_source", "TL_DTYPES"]

TL_DTYPES = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
             torch.float64: "tl.float64", torch.bool: "tl.int1"}
_ROUND_DTYPES = {"bfloat16": "tl.bfloat16", "float16": "tl.float16", "float32": "tl.float32"}
_AXES = {"full": (True, True), "row": (True, False), "col": (False, True), "scalar": (False, False)}


@dataclass
class Sink:
    """Where a kernel puts a value.

    ``role``: ``"output"`` (forward result), ``"grad"`` (gradient of a full or row input,
    stored per element / per row), ``"col_partial"`` (column sums of this program, for a
    column input's gradient) or ``"scalar_partial"`` (one sum per program).
    """
    role: str
    value: Value | None
    name: str            # pointer argument name, without "_ptr"
    kind: str            # axes of the stored tensor ("full", "row", "col", "scalar")
    dtype: torch.dtype
    index: int           # output or input position


@dataclass
class KernelPlan:
    """What one kernel loads, computes and stores."""
    kernel_name: str
    direction: str                 # "forward" or "backward"
    spec: Specialization
    sinks: list
    inputs: list                   # InputSpec read by the kernel (saved for backward)
    grad_outputs: list = field(default_factory=list)   # (OutputSpec, Value, name) read by a backward kernel
    whole_row: bool = False
    persistent: bool = False
    uses_seed: bool = False
    values: list = field(default_factory=list)          # reachable values in topological order
    grad_aliases: dict = field(default_factory=dict)    # input position -> position with the same gradient

    @property
    def reduces_rows(self) -> bool:
        return any(s.role in ("col_partial", "scalar_partial") for s in self.sinks)


def _snake(name: str) -> str:
    """``BiasGeLU`` -> ``bias_gelu``, ``RMSNorm`` -> ``rms_norm`` (a word starts at an
    upper-case letter followed by a lower-case one)."""
    out = []
    for i, ch in enumerate(name):
        nxt = name[i + 1] if i + 1 < len(name) else ""
        if ch.isupper() and i and nxt.islower() and (name[i - 1].isalnum()) and out and out[-1] != "_":
            out.append("_")
        out.append(ch.lower() if ch.isalnum() else "_")
    text = "".join(out).strip("_") or "fused"
    return f"k_{text}" if text[0].isdigit() else text


def _finish(plan: KernelPlan) -> KernelPlan:
    sinks = [s.value for s in plan.sinks] + [v for _, v, _ in plan.grad_outputs]
    plan.values = plan.spec.graph.reachable(sinks)
    used = {v.attr("index") for v in plan.values if v.op == "input"}
    plan.inputs = [inp for k, inp in enumerate(plan.spec.inputs) if k in used]
    used_grads = {v.id for v in plan.values if v.op == "grad_output"}
    plan.grad_outputs = [g for g in plan.grad_outputs if g[1].id in used_grads]
    plan.uses_seed = any(v.op == "keep_mask" for v in plan.values)
    # a row input's gradient is summed over the row; a scalar input's gradient that has no
    # column axis must be counted by one column program only: both want whole rows
    needs_row_sum = any(s.value is not None and ((s.role == "grad" and s.kind == "row" and s.value.cols)
                                                 or (s.role == "scalar_partial" and not s.value.cols))
                        for s in plan.sinks)
    plan.whole_row = needs_row_sum or any(v.op in ("rowsum", "rowmax") for v in plan.values)
    return plan


def forward_plan(spec: Specialization) -> KernelPlan:
    """The forward kernel: compute every output of the subgraph."""
    sinks = [Sink("output", o.value, o.name, _kind_of(o.value), o.dtype, k) for k, o in enumerate(spec.outputs)]
    return _finish(KernelPlan(f"{_snake(spec.name)}_fwd_kernel", "forward", spec, sinks, []))


def backward_plan(spec: Specialization, needs_grad: tuple, has_grad_output: tuple, tag: str = "") -> KernelPlan:
    """The backward kernel for the inputs flagged in ``needs_grad`` (one flag per
    ``spec.inputs``), given which outputs receive a gradient."""
    g = spec.graph
    grad_outputs = []
    for k, (out, present) in enumerate(zip(spec.outputs, has_grad_output)):
        if not present or out.dtype == torch.bool:
            continue
        rows, cols = out.value.rows, out.value.cols
        grad_outputs.append((out, g.grad_output(k, rows, cols, f"d_{out.name[4:] if out.name.startswith('out_') else out.name}"),
                             None))
    # the same output value may be returned twice: gradients add up
    values = [o.value for o, _, _ in grad_outputs]
    grads = derive_gradients(g, values, [v for _, v, _ in grad_outputs],
                             [inp.value for inp in spec.inputs])
    sinks, aliases, stored = [], {}, {}
    for k, (inp, need, grad) in enumerate(zip(spec.inputs, needs_grad, grads)):
        if not need or grad is None or inp.dtype == torch.bool:
            continue
        key = (grad.id, inp.kind, inp.dtype, tuple(inp.shape), inp.expand)
        if inp.kind in ("full", "row") and key in stored:
            # x and residual of x + residual get the same gradient: write it once and
            # hand both the same tensor, as eager autograd does
            aliases[k] = stored[key]
            continue
        stored[key] = k
        if inp.kind in ("full", "row"):
            dtype = spec.compute_dtype if inp.expand else inp.dtype
            sinks.append(Sink("grad", grad, f"d_{inp.name}", inp.kind, dtype, k))
        elif inp.kind == "col":
            sinks.append(Sink("col_partial", grad, f"d_{inp.name}_partial", "col", spec.compute_dtype, k))
        else:
            sinks.append(Sink("scalar_partial", grad, f"d_{inp.name}_partial", "scalar", spec.compute_dtype, k))
    plan = KernelPlan(f"{_snake(spec.name)}_bwd_kernel{tag}", "backward", spec, sinks, [], grad_outputs)
    plan.grad_aliases = aliases
    plan = _finish(plan)
    plan.persistent = plan.reduces_rows
    return plan


def _kind_of(v: Value) -> str:
    return {(True, True): "full", (True, False): "row", (False, True): "col", (False, False): "scalar"}[
        (v.rows, v.cols)]


# --------------------------------------------------------------------------- source emission

def _downcast(expr: str, tl_dtype: str) -> str:
    """Cast to a narrower float type, rounding to nearest even as PyTorch does (``to_bf16``
    is defined in the module prelude)."""
    if tl_dtype == "tl.bfloat16":
        return f"to_bf16({expr})"
    return f"{expr}.to({tl_dtype})"


def _literal(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INF" if value > 0 else "-INF"
    return repr(float(value))


class _Emitter:
    def __init__(self, plan: KernelPlan, interpret: bool):
        self.plan = plan
        self.spec = plan.spec
        self.interpret = interpret
        self.compute = TL_DTYPES[self.spec.compute_dtype]
        self.names: dict[int, str] = {}
        self.taken = {"n_rows", "n_cols", "seed", "pid", "rows", "cols", "mask", "row_mask", "col_mask", "tl",
                      "next_rows", "next_row_mask", "next_mask",
                      "triton", "BLOCK_R", "BLOCK_N", "row_block", "INF", "NAN", "tanh", "tanh_approx", "to_bf16", "n_cols_f", "libdevice",
                      "zero_index"}
        self.taken |= {f"{inp.name}_ptr" for inp in self.spec.inputs}
        self.taken |= {f"{inp.name}_row_stride" for inp in self.spec.inputs}
        self.lines: list[str] = []
        self._counters: dict[str, int] = {}
        self.fast_tanh = not interpret and low_precision(self.spec)

    # ---------------------------------------------------------------- naming
    def _fresh(self, base: str) -> str:
        if base not in self.taken:
            self.taken.add(base)
            return base
        k = self._counters.get(base, 1)
        while f"{base}_{k}" in self.taken:
            k += 1
        self._counters[base] = k + 1
        name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def _base_name(self, v: Value) -> str:
        if v.name_hint:
            return v.name_hint
        origin = v.origin
        if isinstance(origin, tuple) and origin and origin[0] == "grad":
            inner = origin[1]
            while isinstance(inner, tuple):
                inner = inner[1]
            return f"d_{inner}" if inner else "d_tmp"
        return origin if isinstance(origin, str) else "tmp"

    def ref(self, v: Value) -> str:
        """The expression naming ``v`` (a literal for constants)."""
        if v.op == "const":
            return _literal(v.const_value)
        if v.op == "ncols":
            return "n_cols_f"
        if v.op == "alias":
            return self.ref(v.args[0])
        return self.names[v.id]

    def num(self, v: Value) -> str:
        """``v`` as an operand of arithmetic (booleans become 0/1)."""
        text = self.ref(v)
        return f"{text}.to({self.compute})" if v.is_bool and v.op != "const" else text

    # ---------------------------------------------------------------- masks and tiles
    @staticmethod
    def mask_for(rows: bool, cols: bool) -> str | None:
        return {(True, True): "mask", (True, False): "row_mask", (False, True): "col_mask"}.get((rows, cols))

    def tile(self, v: Value, rows: bool, cols: bool) -> str:
        """``v`` broadcast to a tile spanning the given axes."""
        shape = f"[{'BLOCK_R' if rows else 1}, {'BLOCK_N' if cols else 1}]"
        if v.op == "const":
            return f"tl.full({shape}, {_literal(v.const_value)}, {self.compute})"
        if (v.rows, v.cols) == (rows, cols):
            return self.num(v)
        return f"tl.broadcast_to({self.num(v)}, {shape})"

    def offsets(self, name: str, kind: str, row_stride: str | None, prefix: str = "") -> tuple[str, str | None]:
        """Pointer expression and mask for a tensor of the given kind (``prefix="next_"``:
        for the row block a persistent program handles next)."""
        if kind == "full":
            return f"{name}_ptr + {prefix}rows * {row_stride} + cols", f"{prefix}mask"
        if kind == "row":
            return f"{name}_ptr + {prefix}rows * {row_stride}", f"{prefix}row_mask"
        if kind == "col":
            return f"{name}_ptr + cols", "col_mask"
        return f"{name}_ptr + zero_index", None

    # ---------------------------------------------------------------- values
    def expr(self, v: Value, prefix: str = "") -> str:
        op = v.op
        if op == "input":
            inp = self.spec.inputs[v.attr("index")]
            ptr, mask = self.offsets(inp.name, inp.kind, f"{inp.name}_row_stride", prefix)
            masked = f", mask={mask}, other=0" if mask else ""
            if inp.dtype == torch.bool:
                return f"tl.load({ptr}{masked}) != 0"
            convert = "" if inp.dtype == self.spec.compute_dtype else f".to({self.compute})"
            return f"tl.load({ptr}{masked}){convert}"
        if op == "grad_output":
            out = self.spec.outputs[v.attr("index")]
            name = self.names_of_grad_output[v.id]
            ptr, mask = self.offsets(name, _kind_of(v), f"{name}_row_stride", prefix)
            masked = f", mask={mask}, other=0" if mask else ""
            convert = "" if out.dtype == self.spec.compute_dtype else f".to({self.compute})"
            return f"tl.load({ptr}{masked}){convert}"
        if op == "keep_mask":
            # Philox numbers keyed by (seed + dropout index, element index): the backward
            # kernel regenerates the same mask instead of saving it
            return f"tl.rand(seed + {v.attr('index')}, rows * n_cols + cols) >= {_literal(v.attr('p'))}"
        return IR_OPS[op].triton(self, v)

    def round_to(self, expr: str, dtype_name: str) -> str:
        """``expr`` rounded to a narrower float type and back to the compute type."""
        return f"{_downcast(expr, _ROUND_DTYPES[dtype_name])}.to({self.compute})"

    def _comment(self, origin) -> str | None:
        if origin is None:
            return None
        if isinstance(origin, tuple) and origin and origin[0] == "grad":
            inner = origin[1]
            while isinstance(inner, tuple):
                inner = inner[1]
            text = self.spec.node_text.get(inner)
            return f"# gradient through: {text}" if text else "# gradient"
        text = self.spec.node_text.get(origin)
        return f"# {text}" if text else None

    def emit_values(self, values, indent: str):
        last_comment = None
        for v in values:
            if v.op in ("const", "ncols", "alias"):
                continue
            comment = self._comment(v.origin) if v.op not in ("input", "grad_output") else None
            if comment and comment != last_comment:
                self.lines.append(f"{indent}{comment}")
                last_comment = comment
            name = self._fresh(self._base_name(v))
            self.names[v.id] = name
            self.lines.append(f"{indent}{name} = {self.expr(v)}")

    # ---------------------------------------------------------------- kernel
    def signature(self) -> list[str]:
        plan = self.plan
        params = []
        for inp in plan.inputs:
            row = f", {inp.name}_row_stride" if inp.kind in ("full", "row") else ""
            params.append((f"{inp.name}_ptr{row}", f"{inp.name}: {_describe(inp.kind, inp.dtype, plan.spec)}"))
        self.names_of_grad_output = {}
        for out, gv, _ in plan.grad_outputs:
            name = self._fresh(gv.name_hint)
            self.names_of_grad_output[gv.id] = name
            kind = _kind_of(gv)
            row = f", {name}_row_stride" if kind in ("full", "row") else ""
            params.append((f"{name}_ptr{row}", f"gradient of {out.name}: {_describe(kind, out.dtype, plan.spec)}"))
        self.sink_names = {}
        for sink in plan.sinks:
            self.sink_names[id(sink)] = self._fresh(sink.name)
            what = {"output": "", "grad": "gradient ", "col_partial": "per-program column sums ",
                    "scalar_partial": "per-program sums "}[sink.role]
            if sink.role in ("col_partial", "scalar_partial"):
                dt = str(sink.dtype).replace("torch.", "")
                desc = f"(programs, n_cols) {dt}" if sink.role == "col_partial" else f"(programs,) {dt}"
            else:
                desc = _describe(sink.kind, sink.dtype, plan.spec)
            params.append((f"{self.sink_names[id(sink)]}_ptr", f"{what}{desc}"))
        params.append(("n_rows, n_cols", "rows (leading dimensions flattened), last dimension"))
        if plan.uses_seed:
            params.append(("seed", "dropout seed (Philox), the same in forward and backward"))
        params.append(("BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr", ""))
        width = max(len(p) for p, _ in params) + 1
        return [f"    {p + ',':<{width}}  # {c}" if c else f"    {p},"
                for p, c in params]

    def store(self, sink: Sink, indent: str):
        v = sink.value
        name = self.sink_names[id(sink)]
        if sink.role == "output" or sink.role == "grad":
            rows, cols = _AXES[sink.kind]
            stride = "n_cols" if sink.kind == "full" else "1"
            ptr, mask = self.offsets(name, sink.kind, stride)
            value = self.tile(v, rows, cols)
            if sink.dtype != self.spec.compute_dtype:
                value = _downcast(value, TL_DTYPES[sink.dtype])
            # row-invariant results are written once, by the first program (masks built as
            # tensors: a scalar condition is not a valid store mask everywhere)
            if sink.kind == "col":
                mask = "col_mask & ((zero_index + tl.program_id(0)) == 0)"
            elif sink.kind == "scalar":
                mask = "(zero_index + tl.program_id(0) + tl.program_id(1)) == 0"
            if sink.kind == "row" and v.cols:  # gradient of a row input: sum over the row
                value = f"tl.sum(tl.where(mask, {self.tile(v, True, True)}, 0.0), axis=1, keep_dims=True)"
                if sink.dtype != self.spec.compute_dtype:
                    value = _downcast(value, TL_DTYPES[sink.dtype])
            self.lines.append(f"{indent}tl.store({ptr}, {value}, mask={mask})")
        else:
            # gradients always span rows (see autodiff); padded rows and columns add zero
            cols = v.cols
            masked = f"tl.where({self.mask_for(True, cols)}, {self.tile(v, True, cols)}, 0.0)"
            if sink.role == "col_partial":
                self.lines.append(f"{indent}{name}_acc += tl.sum({masked}, axis=0, keep_dims=True)")
            else:
                inner = f"tl.sum({masked}, axis=1, keep_dims=True)" if cols else masked
                self.lines.append(f"{indent}{name}_acc += tl.sum({inner}, axis=0, keep_dims=True)")

    def kernel(self) -> str:
        plan, spec = self.plan, self.spec
        head = ["@triton.jit", f"def {plan.kernel_name}("]
        head += self.signature()
        head.append("):")
        doc = _kernel_doc(plan)
        self.lines = [f'    """{doc[0]}'] + [f"    {line}" if line else "" for line in doc[1:]] + ['    """']
        uses_scalar = any(v.op == "input" and spec.inputs[v.attr("index")].kind == "scalar" for v in plan.values) \
            or any(v.op == "grad_output" and not v.rows and not v.cols for v in plan.values) \
            or any(s.kind in ("scalar", "col") and s.role in ("output", "grad") for s in plan.sinks)
        if plan.whole_row:
            self.lines.append("    cols = tl.arange(0, BLOCK_N)[None, :]  # the whole row: BLOCK_N >= n_cols")
        else:
            self.lines.append("    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
        self.lines.append("    col_mask = cols < n_cols")
        if uses_scalar:
            self.lines.append("    zero_index = tl.zeros([1, 1], dtype=tl.int32)")
        if any(v.op == "ncols" for v in plan.values):
            self.lines.append("    n_cols_f = n_cols * 1.0")
        row_lines = [
            "rows = {start} + tl.arange(0, BLOCK_R)[:, None]",
            "row_mask = rows < n_rows",
            "mask = row_mask & col_mask",
        ]
        if spec.n_rows * max(spec.n_cols, 1) >= 2 ** 31 - 1:
            row_lines[0] = "rows = ({start} + tl.arange(0, BLOCK_R)[:, None]).to(tl.int64)"
        if plan.persistent:
            invariant = [v for v in plan.values if not v.rows]
            varying = [v for v in plan.values if v.rows]
            self.emit_values(invariant, "    ")
            for sink in plan.sinks:
                name = self.sink_names[id(sink)]
                if sink.role == "col_partial":
                    self.lines.append(f"    {name}_acc = tl.zeros([1, BLOCK_N], dtype={self.compute})")
                elif sink.role == "scalar_partial":
                    self.lines.append(f"    {name}_acc = tl.zeros([1, 1], dtype={self.compute})")
            loads = [v for v in varying if v.op in ("input", "grad_output")]
            computed = [v for v in varying if v.op not in ("input", "grad_output")]
            load_names = {v.id: self._fresh(self._base_name(v)) for v in loads}
            if loads:
                self.lines.append("    # the first row block's tiles; each iteration then loads the next block's "
                                  "before computing its own,")
                self.lines.append("    # so memory latency overlaps the arithmetic and the row reductions")
                for line in row_lines:
                    self.lines.append("    " + line.format(start="tl.program_id(0) * BLOCK_R"))
                for v in loads:
                    self.lines.append(f"    {load_names[v.id]}_next = {self.expr(v)}")
            self.lines.append("    # each program walks the row blocks pid, pid + programs, ... and keeps its column "
                              "sums in registers")
            self.lines.append("    for row_block in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_R), "
                              "tl.num_programs(0)):")
            for line in row_lines:
                self.lines.append("        " + line.format(start="row_block * BLOCK_R"))
            if loads:
                self.lines.append("        next_rows = rows + tl.num_programs(0) * BLOCK_R")
                self.lines.append("        next_row_mask = next_rows < n_rows")
                self.lines.append("        next_mask = next_row_mask & col_mask")
                for v in loads:
                    self.names[v.id] = load_names[v.id]
                    self.lines.append(f"        {load_names[v.id]} = {load_names[v.id]}_next")
                for v in loads:
                    self.lines.append(f"        {load_names[v.id]}_next = {self.expr(v, 'next_')}")
            self.emit_values(computed, "        ")
            for sink in plan.sinks:
                if sink.role in ("grad", "output"):
                    self.store(sink, "        ")
            for sink in plan.sinks:
                if sink.role in ("col_partial", "scalar_partial"):
                    self.store(sink, "        ")
            for sink in plan.sinks:
                name = self.sink_names[id(sink)]
                if sink.role == "col_partial":
                    self.lines.append(f"    tl.store({name}_ptr + tl.program_id(0) * n_cols + cols, "
                                      f"{name}_acc, mask=col_mask)")
                elif sink.role == "scalar_partial":
                    self.lines.append(f"    tl.store({name}_ptr + tl.program_id(0) * tl.num_programs(1) "
                                      f"+ tl.program_id(1) + tl.zeros([1, 1], dtype=tl.int32), {name}_acc)")
        else:
            for line in row_lines:
                self.lines.append("    " + line.format(start="tl.program_id(0) * BLOCK_R"))
            self.emit_values(plan.values, "    ")
            for sink in plan.sinks:
                self.store(sink, "    ")
        return "\n".join(head + self.lines)


def low_precision(spec: Specialization) -> bool:
    """Whether every floating-point tensor the subgraph reads or writes is 16-bit: then the
    hardware tanh (relative error about 2**-11, under half a bfloat16 ulp) is accurate enough."""
    dtypes = [i.dtype for i in spec.inputs if i.dtype.is_floating_point]
    dtypes += [o.dtype for o in spec.outputs if o.dtype.is_floating_point]
    return bool(dtypes) and all(d in (torch.bfloat16, torch.float16) for d in dtypes)


def _describe(kind: str, dtype: torch.dtype, spec: Specialization) -> str:
    dt = str(dtype).replace("torch.", "")
    return {"full": f"(n_rows, n_cols) {dt}", "row": f"(n_rows,) {dt}", "col": f"(n_cols,) {dt}",
            "scalar": f"scalar {dt}"}[kind]


def _bytes(kind: str, dtype: torch.dtype, spec: Specialization) -> int:
    n = {"full": spec.n_rows * spec.n_cols, "row": spec.n_rows, "col": spec.n_cols, "scalar": 1}[kind]
    return n * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1)


def _size(n: int) -> str:
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _kernel_doc(plan: KernelPlan) -> list[str]:
    spec = plan.spec
    read = sum(_bytes(inp.kind, inp.dtype, spec) for inp in plan.inputs)
    read += sum(_bytes(_kind_of(v), out.dtype, spec) for out, v, _ in plan.grad_outputs)
    written = sum(_bytes(s.kind, s.dtype, spec) for s in plan.sinks if s.role in ("output", "grad"))
    mode = ("persistent row loop" if plan.persistent else "whole rows per program" if plan.whole_row
            else "2-D tiles of BLOCK_R x BLOCK_N")
    lines = [f"{plan.direction.capitalize()} of '{spec.name}' ({mode}).", ""]
    names = ", ".join(i.name for i in plan.inputs) or "nothing"
    if plan.direction == "forward":
        lines.append(f"Reads {names}; writes {', '.join(s.name for s in plan.sinks)}.")
    else:
        grads = ", ".join(f"d_{spec.inputs[s.index].name}" for s in plan.sinks)
        for k, other in plan.grad_aliases.items():
            grads += f" (d_{spec.inputs[k].name} is the same tensor as d_{spec.inputs[other].name})"
        lines.append(f"Recomputes the forward from {names} (nothing else is saved) and writes {grads}.")
    lines.append(f"Memory traffic at {spec.n_rows} x {spec.n_cols}: {_size(read)} read, {_size(written)} written "
                 "(each tensor once: the floor of this kernel).")
    return lines


_PRELUDE_GPU = '''import triton
import triton.language as tl
from triton.language.extra import libdevice

INF = tl.constexpr(float("inf"))
NAN = tl.constexpr(float("nan"))


@triton.jit
def tanh(x):
    return libdevice.tanh(x)


@triton.jit
def tanh_approx(x):
    # one MUFU instruction (max relative error about 2**-11): used when every tensor is 16-bit
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def to_bf16(x):
    return x.to(tl.bfloat16)
'''

_PRELUDE_INTERPRET = '''import triton
import triton.language as tl

INF = tl.constexpr(float("inf"))
NAN = tl.constexpr(float("nan"))


@triton.jit
def tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits at +-inf (the interpreter has no libdevice)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def to_bf16(x):
    # round to nearest even on the bits: the interpreter's float32 -> bfloat16 cast truncates
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
'''


def module_source(spec: Specialization, plans: list[KernelPlan], interpret: bool) -> str:
    """A complete Python module holding the kernels of ``plans``."""
    header = [f'"""Triton kernels generated by schedlang for the fused subgraph \'{spec.name}\'.', ""]
    ins = ", ".join(f"{i.name}: {tuple(i.shape)} {str(i.dtype).replace('torch.', '')}" for i in spec.inputs)
    outs = ", ".join(f"{tuple(o.shape)} {str(o.dtype).replace('torch.', '')}" for o in spec.outputs)
    header.append(f"Inputs {ins} -> outputs {outs}.")
    header.append(f"Grid: n_rows = {spec.n_rows} (leading dimensions flattened), n_cols = {spec.n_cols} "
                  f"(last dimension); computed in {str(spec.compute_dtype).replace('torch.', '')}.")
    header.append("")
    header.append("Subgraph:")
    header += [f"    {text}" for text in spec.node_text.values()]
    header.append('"""')
    parts = ["\n".join(header), _PRELUDE_INTERPRET if interpret else _PRELUDE_GPU]
    for plan in plans:
        parts.append(_Emitter(plan, interpret).kernel())
    return "\n\n".join(parts) + "\n"
