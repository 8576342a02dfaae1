"""Adam / AdamW over many tensors in one Triton launch.

Maths, per element, in fp32 (``t`` is the step count after this step, ``g`` the gradient,
negated when maximizing)::

    p  = p * (1 - lr * wd)                      # AdamW (decoupled weight decay)
    g  = g + wd * p                             # Adam (L2 penalty folded into the gradient)
    m  = m + (1 - beta1) * (g - m)              # exp_avg (a lerp, as torch.optim does it)
    v  = beta2 * v + (1 - beta2) * g * g        # exp_avg_sq
    vm = max(vm, v)                             # amsgrad only: max_exp_avg_sq
    p  = p - lr / (1 - beta1^t) * m / (sqrt(v or vm) / sqrt(1 - beta2^t) + eps)

The bias corrections ``1 - beta^t`` are computed inside the kernel from the step tensor, as
``-expm1(t * log(beta))``: ``1 - beta2^t`` is about 1e-3 at t = 1 and forming ``beta2^t`` first
would cancel half of fp32's digits. The learning rate is read from a device tensor when it is
one, so a schedule changing it neither recompiles nor waits for the device, and a captured CUDA
graph picks up the new value on replay.

Bytes moved per element: read p, g, m, v and write p, m, v (7 passes of 4 bytes for fp32
parameters; 2-byte p and g for bf16 parameters with fp32 state: 5 * 4 + 3 * 2 = 18 bytes;
amsgrad adds a read and a write of vm). This is the floor; the kernel is memory bound.

Launch shape: one program per chunk of ``chunk_size`` elements of one tensor, found through the
chunk map (see :mod:`schedlang.kernels.multi_tensor_apply`). Inside a chunk, full blocks are
loaded without a mask and, when every address is 16-byte aligned, with 16-byte vector accesses;
only a tensor's last block is masked. A second, tiny launch adds one to every step tensor first.
bf16 parameters are stored back rounded to nearest even (done with integer arithmetic so that the
numpy interpreter, which truncates on that conversion, rounds as the GPU does).

Master weights: with ``masters`` (one fp32 tensor per parameter), ``p`` above is read from and
written to the master, and the parameter (bf16 or fp16, the copy the model computes with) is only
written: the master rounded to nearest even. Bytes per element for bf16 parameters and gradients:
read master, g, m, v and write master, m, v, p: 6 * 4 + 2 * 2 = 28 bytes, against 7 * 4 = 28 for
fp32 parameters updated in place (and the model's per-step weight casts disappear).

Example::

    multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr_tensor,
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                      decoupled_weight_decay=True, tables=ChunkTables())
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from schedlang.kernels.multi_tensor_adam_reference import multi_tensor_adam_reference
from schedlang.kernels.multi_tensor_apply import ROW_WIDTH, ChunkTables, is_dense, use_triton
from schedlang.kernels.multi_tensor_chunks import chunk_pointer, learning_rate, program_param_and_grad

__all__ = ["multi_tensor_adam", "AdamLauncher", "reference", "DEFAULT_CONFIG", "INTERPRETER_CONFIG"]

reference = multi_tensor_adam_reference

# tensor table columns
_P, _G, _M, _V, _VMAX, _STEP, _MASTER = range(7)

#: launch shape on a GPU: elements per program, elements per loop iteration, warps. The best of
#: bench/bench_optim.py --sweep on an H200 (bench/results/2026-11-21-optim.md; the configurations
#: tried were within 4% of each other); small chunks also keep small models' launches wide
DEFAULT_CONFIG = {"chunk_size": 8192, "block_size": 1024, "num_warps": 4}
#: the numpy interpreter runs programs one by one: small blocks keep tests fast
INTERPRETER_CONFIG = {"chunk_size": 2048, "block_size": 512, "num_warps": 4}

_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# log(0) would be -inf; any very negative number gives beta^t == 0 just the same
_LOG_OF_ZERO = -1.0e30


@triton.jit
def _one_minus_pow(log_beta, t):
    """1 - beta^t = -expm1(t * log(beta)), accurate when the result is small."""
    y = t * log_beta
    ys = tl.maximum(y, -0.5)
    # Taylor series of expm1 up to y^10 in Horner form: the truncation error is below 1e-11
    # for |y| <= 0.5; beyond that exp(y) - 1 loses nothing
    poly = ys * (1.0 + ys / 2.0 * (1.0 + ys / 3.0 * (1.0 + ys / 4.0 * (1.0 + ys / 5.0 * (
        1.0 + ys / 6.0 * (1.0 + ys / 7.0 * (1.0 + ys / 8.0 * (1.0 + ys / 9.0 * (1.0 + ys / 10.0)))))))))
    return -tl.where(y > -0.5, poly, tl.exp(y) - 1.0)


@triton.jit
def _store_rounded(ptr, x, mask, DTYPE: tl.constexpr):
    """Store fp32 ``x`` as DTYPE, rounding to nearest even."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # a NaN must stay a NaN (the carry above could turn it into an infinity)
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        tl.store(ptr, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x.to(DTYPE), mask=mask)


@triton.jit
def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, offs, mask,
                lr, step_size, inv_sqrt_bc2, one_minus_beta1, beta2, one_minus_beta2, eps,
                weight_decay,
                PARAM_DTYPE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                DECOUPLED: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, HAS_MASTER: tl.constexpr):
    if HAS_MASTER:  # the fp32 truth; the parameter is only written
        p = tl.load(master_ptr + offs, mask=mask)
    else:
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if MAXIMIZE:
        g = -g
    if HAS_WEIGHT_DECAY:
        if DECOUPLED:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if AMSGRAD:
        vmax = tl.maximum(tl.load(vmax_ptr + offs, mask=mask), v)
        tl.store(vmax_ptr + offs, vmax, mask=mask)
        denom = tl.sqrt(vmax) * inv_sqrt_bc2 + eps
    else:
        denom = tl.sqrt(v) * inv_sqrt_bc2 + eps
    p = p - step_size * (m / denom)
    if HAS_MASTER:
        tl.store(master_ptr + offs, p, mask=mask)
    _store_rounded(p_ptr + offs, p, mask, PARAM_DTYPE)


@triton.jit
def _multi_tensor_adam_kernel(
    tensor_table, chunk_map, lr_ptr, lr_value,
    beta1, beta2, one_minus_beta1, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, HAS_MASTER: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr,
):
    row, start, size, full, p_ptr, g_ptr = program_param_and_grad(tensor_table, chunk_map, PARAM_DTYPE, GRAD_DTYPE,
                                                                  ALIGNED, CHUNK, BLOCK, ROW)
    m_ptr = chunk_pointer(row, 2, tl.float32, ALIGNED, start)
    v_ptr = chunk_pointer(row, 3, tl.float32, ALIGNED, start)
    vmax_ptr = chunk_pointer(row, 4, tl.float32, ALIGNED, start)
    master_ptr = chunk_pointer(row, 6, tl.float32, ALIGNED, start)
    step_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))

    lr = learning_rate(lr_ptr, lr_value, LR_ON_DEVICE)
    step = tl.load(step_ptr)
    bias_correction1 = _one_minus_pow(log_beta1, step)
    bias_correction2 = _one_minus_pow(log_beta2, step)
    step_size = lr / bias_correction1
    inv_sqrt_bc2 = 1.0 / tl.sqrt(bias_correction2)

    # full blocks: no mask, so the accesses stay vectorized
    for i in range(0, full, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, offs, None,
                    lr, step_size, inv_sqrt_bc2, one_minus_beta1, beta2, one_minus_beta2, eps,
                    weight_decay, PARAM_DTYPE, AMSGRAD, MAXIMIZE, DECOUPLED, HAS_WEIGHT_DECAY, HAS_MASTER)
    if full < size:
        offs = full + tl.arange(0, BLOCK)
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, master_ptr, offs, offs < size,
                    lr, step_size, inv_sqrt_bc2, one_minus_beta1, beta2, one_minus_beta2, eps,
                    weight_decay, PARAM_DTYPE, AMSGRAD, MAXIMIZE, DECOUPLED, HAS_WEIGHT_DECAY, HAS_MASTER)


@triton.jit
def _increment_steps_kernel(tensor_table, n_tensors, STEP_COLUMN: tl.constexpr, ROW: tl.constexpr,
                            BLOCK: tl.constexpr):
    """step += 1 for every tensor of the table (each has its own 0-d fp32 step tensor)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n_tensors
    addr = tl.load(tensor_table + idx * ROW + STEP_COLUMN, mask=mask, other=0)
    ptrs = addr.to(tl.pointer_type(tl.float32))
    tl.store(ptrs, tl.load(ptrs, mask=mask) + 1.0, mask=mask)


def _log(beta: float) -> float:
    return math.log(beta) if beta > 0 else _LOG_OF_ZERO


class AdamLauncher:
    """A prepared Adam(W) launch over fixed lists of tensors; call it once per step.

    The constructor builds (or takes from ``tables``) the device tables; the launcher keeps
    references to the parameters and state but not to the gradients, whose addresses it
    recorded: the caller passes the same gradients (same addresses) to every call. Tensors
    that are not contiguous, and CPU tensors without the Triton interpreter, go through
    :func:`reference` on each call. ``masters`` (fp32, one per parameter, or None) turns on
    master weights: see :func:`multi_tensor_adam`.

    Example::

        launch = AdamLauncher(params, grads, exp_avgs, exp_avg_sqs, [], steps)
        launch(grads, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    """

    def __init__(self, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
                 amsgrad: bool = False, masters=None, tables: ChunkTables | None = None,
                 config: dict | None = None):
        n = len(params)
        self.amsgrad = amsgrad
        self.has_master = bool(masters)
        vmaxes = list(max_exp_avg_sqs) if amsgrad else [None] * n
        masters = list(masters) if self.has_master else [None] * n
        device = params[0].device if n else torch.device("cpu")
        triton_ok = use_triton(device)
        dense = [triton_ok and is_dense(p, g, m, v, vm, w)
                 for p, g, m, v, vm, w in zip(params, grads, exp_avgs, exp_avg_sqs, vmaxes, masters)]
        self.strided = [i for i, d in enumerate(dense) if not d]
        self.strided_state = [(params[i], exp_avgs[i], exp_avg_sqs[i], vmaxes[i], state_steps[i], masters[i])
                              for i in self.strided]
        keep = [i for i, d in enumerate(dense) if d]
        self.n_kernel = len(keep)
        if not keep:
            return
        cfg = dict(INTERPRETER_CONFIG if device.type == "cpu" else DEFAULT_CONFIG)
        cfg.update(config or {})
        self.config = cfg
        rows = [(params[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                 vmaxes[i].data_ptr() if amsgrad else 0, state_steps[i].data_ptr(),
                 masters[i].data_ptr() if self.has_master else 0) for i in keep]
        tables = tables if tables is not None else ChunkTables()
        self.tensor_table, self.chunk_map, self.aligned = tables.get(
            rows, [params[i].numel() for i in keep], cfg["chunk_size"], device)
        self.param_dtype = _TRITON_DTYPES[params[keep[0]].dtype]
        self.grad_dtype = _TRITON_DTYPES[grads[keep[0]].dtype]
        # the kernel reads through raw addresses: keep what it writes alive with the tables
        self._alive = [(params[i], exp_avgs[i], exp_avg_sqs[i], vmaxes[i], state_steps[i], masters[i])
                       for i in keep]

    def __call__(self, grads, *, lr, beta1: float, beta2: float, eps: float, weight_decay: float,
                 maximize: bool = False, decoupled_weight_decay: bool = False) -> None:
        if self.strided:
            p, m, v, vm, s, w = (list(x) for x in zip(*self.strided_state))
            reference(p, [grads[i] for i in self.strided], m, v, vm if self.amsgrad else [], s,
                      lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=self.amsgrad,
                      maximize=maximize, decoupled_weight_decay=decoupled_weight_decay,
                      masters=w if self.has_master else None)
        if not self.n_kernel:
            return
        n = self.n_kernel
        _increment_steps_kernel[(triton.cdiv(n, 1024),)](self.tensor_table, n, STEP_COLUMN=_STEP, ROW=ROW_WIDTH,
                                                        BLOCK=1024, num_warps=4)
        lr_on_device = isinstance(lr, torch.Tensor)
        cfg = self.config
        _multi_tensor_adam_kernel[(self.chunk_map.shape[0],)](
            self.tensor_table, self.chunk_map, lr if lr_on_device else self.tensor_table,
            0.0 if lr_on_device else float(lr),
            # 1 - beta in double on the host: in fp32, 1 - fp32(0.99999) is 1.36e-4 off in relative terms
            float(beta1), float(beta2), 1.0 - float(beta1), 1.0 - float(beta2), _log(beta1), _log(beta2),
            float(eps), float(weight_decay),
            PARAM_DTYPE=self.param_dtype, GRAD_DTYPE=self.grad_dtype, LR_ON_DEVICE=lr_on_device,
            AMSGRAD=self.amsgrad, MAXIMIZE=bool(maximize), DECOUPLED=bool(decoupled_weight_decay),
            HAS_WEIGHT_DECAY=weight_decay != 0, HAS_MASTER=self.has_master, ALIGNED=self.aligned,
            CHUNK=cfg["chunk_size"], BLOCK=cfg["block_size"], ROW=ROW_WIDTH, num_warps=cfg["num_warps"],
        )


def multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
                      lr, beta1: float, beta2: float, eps: float, weight_decay: float,
                      amsgrad: bool = False, maximize: bool = False,
                      decoupled_weight_decay: bool = False, masters=None, tables: ChunkTables | None = None,
                      config: dict | None = None) -> None:
    """One Adam(W) step over lists of tensors, in place: steps, state and parameters.

    All tensors are plain tensors on one device: ``params`` of one dtype (fp32, bf16 or fp16),
    ``grads`` of one dtype, fp32 ``exp_avgs``/``exp_avg_sqs`` (and ``max_exp_avg_sqs`` when
    ``amsgrad``, else ``[]``) shaped like the params, and 0-d fp32 ``state_steps`` on the same
    device (incremented here). ``lr`` is a float or a 0-d tensor on that device. ``tables``
    keeps the launch tables between calls; ``config`` overrides the launch shape
    (``chunk_size``, ``block_size``: powers of two, ``num_warps``).

    ``masters``, when given (a list of fp32 tensors shaped like the params, one per param),
    holds the values the update applies to: each is read and written in fp32, and its param
    (typically bf16 or fp16) is overwritten with the new master rounded to nearest even.

    Tensors that are not contiguous, and CPU tensors when the Triton interpreter is off, go
    through :func:`reference`.

    Example::

        multi_tensor_adam([w], [w.grad], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.0)
    """
    if not params:
        return
    AdamLauncher(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad=amsgrad,
                 masters=masters, tables=tables, config=config)(
        grads, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay)
