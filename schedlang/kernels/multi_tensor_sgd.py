"""SGD with momentum, dampening and Nesterov over many tensors in one Triton launch.

Maths, per element, in fp32 (``g`` negated when maximizing; ``b`` the fp32 momentum buffer)::

    g = g + wd * p                              # L2 weight decay
    b = g                                       # first step of a fresh buffer
    b = momentum * b + (1 - dampening) * g      # later steps
    d = g + momentum * b  (nesterov)  or  b
    p = p - lr * d

Bytes moved per element: read p, g, b and write p, b (5 passes of 4 bytes for fp32; without
momentum read p, g and write p). A fresh buffer is written without being read, through a flag
in its tensor-table row that the host clears after that step. The launch shape and the tables
are those of :mod:`schedlang.kernels.multi_tensor_adam`; lr is read from a device tensor when it
is one (no recompilation, no host synchronization, CUDA-graph friendly).

Example::

    multi_tensor_sgd(params, grads, buffers, [True] * len(params), lr=0.1, momentum=0.9,
                     dampening=0.0, weight_decay=1e-4, nesterov=True, tables=ChunkTables())
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from schedlang.kernels.multi_tensor_adam import DEFAULT_CONFIG, INTERPRETER_CONFIG, _store_rounded
from schedlang.kernels.multi_tensor_apply import ROW_WIDTH, ChunkTables, is_dense, use_triton
from schedlang.kernels.multi_tensor_chunks import chunk_pointer, learning_rate, program_param_and_grad
from schedlang.kernels.multi_tensor_sgd_reference import multi_tensor_sgd_reference

__all__ = ["multi_tensor_sgd", "SGDLauncher", "reference"]

reference = multi_tensor_sgd_reference

# tensor table columns
_P, _G, _BUF, _FRESH = range(4)

_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _sgd_block(p_ptr, g_ptr, b_ptr, offs, mask, fresh, lr, momentum, dampening, weight_decay,
               PARAM_DTYPE: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if HAS_WEIGHT_DECAY:
        g = g + weight_decay * p
    if HAS_MOMENTUM:
        if fresh:
            b = g
        else:
            b = tl.load(b_ptr + offs, mask=mask) * momentum + (1.0 - dampening) * g
        tl.store(b_ptr + offs, b, mask=mask)
        if NESTEROV:
            g = g + momentum * b
        else:
            g = b
    _store_rounded(p_ptr + offs, p - lr * g, mask, PARAM_DTYPE)


@triton.jit
def _multi_tensor_sgd_kernel(
    tensor_table, chunk_map, lr_ptr, lr_value, momentum, dampening, weight_decay,
    PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr, LR_ON_DEVICE: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr, ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr,
):
    row, start, size, full, p_ptr, g_ptr = program_param_and_grad(tensor_table, chunk_map, PARAM_DTYPE, GRAD_DTYPE,
                                                                  ALIGNED, CHUNK, BLOCK, ROW)
    b_ptr = chunk_pointer(row, 2, tl.float32, ALIGNED, start)
    fresh = tl.load(row + 3) != 0
    lr = learning_rate(lr_ptr, lr_value, LR_ON_DEVICE)
    for i in range(0, full, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        _sgd_block(p_ptr, g_ptr, b_ptr, offs, None, fresh, lr, momentum, dampening, weight_decay,
                   PARAM_DTYPE, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WEIGHT_DECAY)
    if full < size:
        offs = full + tl.arange(0, BLOCK)
        _sgd_block(p_ptr, g_ptr, b_ptr, offs, offs < size, fresh, lr, momentum, dampening, weight_decay,
                   PARAM_DTYPE, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WEIGHT_DECAY)


class SGDLauncher:
    """A prepared SGD launch over fixed lists of tensors; call it once per step.

    Keeps references to parameters and buffers, not to gradients (see
    :class:`~schedlang.kernels.multi_tensor_adam.AdamLauncher`). ``fresh[i]`` marks a buffer
    allocated for the first call: that call writes it without reading it, later calls read it.

    Example::

        launch = SGDLauncher(params, grads, buffers, [True] * len(params), has_momentum=True)
        launch(grads, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0)
    """

    def __init__(self, params, grads, momentum_buffers, fresh, *, has_momentum: bool = True,
                 tables: ChunkTables | None = None, config: dict | None = None):
        n = len(params)
        self.has_momentum = has_momentum
        buffers = list(momentum_buffers) if has_momentum else [None] * n
        fresh = [bool(f) for f in fresh] if has_momentum else [False] * n
        device = params[0].device if n else torch.device("cpu")
        triton_ok = use_triton(device)
        dense = [triton_ok and is_dense(p, g, b) for p, g, b in zip(params, grads, buffers)]
        self.strided = [i for i, d in enumerate(dense) if not d]
        self.strided_state = [[params[i], buffers[i], fresh[i]] for i in self.strided]
        keep = [i for i, d in enumerate(dense) if d]
        self.n_kernel = len(keep)
        self.any_fresh = any(fresh[i] for i in keep)
        if not keep:
            return
        cfg = dict(INTERPRETER_CONFIG if device.type == "cpu" else DEFAULT_CONFIG)
        cfg.update(config or {})
        self.config = cfg
        rows = [(params[i].data_ptr(), grads[i].data_ptr(), buffers[i].data_ptr() if has_momentum else 0,
                 int(fresh[i])) for i in keep]
        self.tables = tables if tables is not None else ChunkTables()
        self.tensor_table, self.chunk_map, self.aligned = self.tables.get(
            rows, [params[i].numel() for i in keep], cfg["chunk_size"], device)
        self.param_dtype = _TRITON_DTYPES[params[keep[0]].dtype]
        self.grad_dtype = _TRITON_DTYPES[grads[keep[0]].dtype]
        self._alive = [(params[i], buffers[i]) for i in keep]

    def __call__(self, grads, *, lr, momentum: float, dampening: float, weight_decay: float,
                 nesterov: bool = False, maximize: bool = False) -> None:
        kwargs = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                      nesterov=nesterov, maximize=maximize)
        if self.strided:
            p, b, f = (list(x) for x in zip(*self.strided_state))
            reference(p, [grads[i] for i in self.strided], b, f, **kwargs)
            for entry in self.strided_state:
                entry[2] = False
        if not self.n_kernel:
            return
        lr_on_device = isinstance(lr, torch.Tensor)
        cfg = self.config
        _multi_tensor_sgd_kernel[(self.chunk_map.shape[0],)](
            self.tensor_table, self.chunk_map, lr if lr_on_device else self.tensor_table,
            0.0 if lr_on_device else float(lr), float(momentum), float(dampening), float(weight_decay),
            PARAM_DTYPE=self.param_dtype, GRAD_DTYPE=self.grad_dtype, LR_ON_DEVICE=lr_on_device,
            HAS_MOMENTUM=self.has_momentum, NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
            HAS_WEIGHT_DECAY=weight_decay != 0, ALIGNED=self.aligned,
            CHUNK=cfg["chunk_size"], BLOCK=cfg["block_size"], ROW=ROW_WIDTH, num_warps=cfg["num_warps"],
        )
        if self.any_fresh:
            # the buffers hold their first value now: later steps must read them
            self.tables.zero_column(_FRESH)
            self.any_fresh = False


def multi_tensor_sgd(params, grads, momentum_buffers, fresh, *, lr, momentum: float, dampening: float,
                     weight_decay: float, nesterov: bool = False, maximize: bool = False,
                     tables: ChunkTables | None = None, config: dict | None = None) -> None:
    """One SGD step over lists of tensors, in place (parameters and momentum buffers).

    ``params`` of one dtype (fp32, bf16 or fp16) on one device, ``grads`` of one dtype, fp32
    ``momentum_buffers`` shaped like the params (ignored, may be ``[]``, when ``momentum == 0``),
    ``fresh[i]`` True for a buffer allocated for this step. ``lr`` is a float or a 0-d tensor on
    the device. ``tables`` keeps the launch tables between calls; ``config`` overrides the
    launch shape. Non-contiguous tensors, and CPU tensors without the Triton interpreter, go
    through :func:`reference`.

    Example::

        multi_tensor_sgd([w], [w.grad], [], [False], lr=0.1, momentum=0.0, dampening=0.0,
                         weight_decay=0.0)
    """
    if not params:
        return
    SGDLauncher(params, grads, momentum_buffers, fresh, has_momentum=momentum != 0, tables=tables,
                config=config)(grads, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                               nesterov=nesterov, maximize=maximize)
