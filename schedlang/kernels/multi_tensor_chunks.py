"""Triton helpers shared by the multi-tensor optimizer kernels: which chunk of which tensor a
program updates, and the learning rate it reads.

Every program of a multi-tensor launch updates one chunk of ``CHUNK`` elements of one tensor.
``chunk_map`` holds a ``(tensor index, chunk index)`` pair per program, and row ``t`` of
``tensor_table`` holds the addresses of tensor ``t``'s parameter, gradient and state, with its
element count in the last column (:class:`~schedlang.kernels.multi_tensor_apply.ChunkTables`).
"""

import triton
import triton.language as tl


@triton.jit
def program_chunk(tensor_table, chunk_map, ROW: tl.constexpr):
    """(the table row of this program's tensor, its chunk index, the tensor's element count)."""
    pid = tl.program_id(0)
    t = tl.load(chunk_map + 2 * pid).to(tl.int64)
    chunk = tl.load(chunk_map + 2 * pid + 1).to(tl.int64)
    row = tensor_table + t * ROW
    numel = tl.load(row + ROW - 1)
    return row, chunk, numel


@triton.jit
def chunk_extent(chunk, numel, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """(first element of the chunk, its length, the length covered by whole BLOCKs)."""
    start = chunk * CHUNK
    size = tl.minimum(numel - start, CHUNK)
    full = size // BLOCK * BLOCK
    return start, size, full


@triton.jit
def learning_rate(lr_ptr, lr_value, LR_ON_DEVICE: tl.constexpr):
    """The step's learning rate: read from device memory (a tensor lr, no host sync) or passed by value."""
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    else:
        lr = lr_value
    return lr


@triton.jit
def chunk_pointer(row, COLUMN: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr, start):
    """Address of element ``start`` of the tensor whose address is in ``COLUMN`` of ``row``.

    With ``ALIGNED`` every tensor address is a multiple of 16 bytes (checked on the host), which
    the hint passes on to the compiler so that full blocks use 16-byte accesses.
    """
    ptr = tl.load(row + COLUMN).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr + start


@triton.jit
def program_param_and_grad(tensor_table, chunk_map, PARAM_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
                           ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr):
    """What every optimizer program starts from: (its table row, the chunk's first element, its
    length, the length covered by whole BLOCKs, the chunk's parameter and gradient addresses).
    Columns 0 and 1 of a row hold the parameter and the gradient; the optimizer's state follows."""
    row, chunk, numel = program_chunk(tensor_table, chunk_map, ROW)
    start, size, full = chunk_extent(chunk, numel, CHUNK, BLOCK)
    p_ptr = chunk_pointer(row, 0, PARAM_DTYPE, ALIGNED, start)
    g_ptr = chunk_pointer(row, 1, GRAD_DTYPE, ALIGNED, start)
    return row, start, size, full, p_ptr, g_ptr
