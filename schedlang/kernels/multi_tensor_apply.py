"""Host-side machinery shared by the multi-tensor optimizer kernels.

A multi-tensor kernel updates hundreds of tensors of different sizes in one launch. Each program
of the launch owns one *chunk*: ``chunk_size`` consecutive elements of one tensor. Two small
int tables on the device tell a program what to do:

* the **tensor table**, one row of :data:`ROW_WIDTH` int64 per tensor: the addresses of the
  tensors that belong together (parameter, gradient, optimizer state...), other per-tensor
  integers (a flag), and the tensor's element count in the last column;
* the **chunk map**, one ``(tensor index, chunk index)`` int32 pair per program.

Building them costs a few host->device copies, so :class:`ChunkTables` keeps them and rebuilds
only when an address or a size changes: a new parameter set, gradients re-allocated at other
addresses (``zero_grad(set_to_none=True)`` usually gets the same blocks back from the caching
allocator), a state tensor replaced by ``load_state_dict``.

Example::

    tables = ChunkTables()
    rows = [(p.data_ptr(), g.data_ptr()) for p, g in zip(params, grads)]
    tensor_table, chunk_map, aligned = tables.get(rows, [p.numel() for p in params], 4096, device)
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["ROW_WIDTH", "ChunkTables", "interpreting", "use_triton", "is_dense"]

logger = logging.getLogger("schedlang.kernels.multi_tensor_apply")

#: int64 columns per tensor row (64 bytes: one row is one cache line).
ROW_WIDTH = 8
#: the last column of a row holds the tensor's element count.
NUMEL_COLUMN = ROW_WIDTH - 1
#: vector loads of 16 bytes need every address of a launch to be a multiple of this.
VECTOR_BYTES = 16


def _interpret_switch() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton chooses between the interpreter and the compiler when ``@triton.jit`` decorates a function,
# that is when this package's kernel modules are imported. Setting the variable later (a script that
# sets it after importing schedlang on a GPU machine) would send CPU pointers to compiled kernels, so the
# switch as it was at import is what counts.
_INTERPRETED_AT_IMPORT = _interpret_switch()


def interpreting() -> bool:
    """True when this package's Triton kernels run under the numpy interpreter: ``TRITON_INTERPRET=1``
    was set when schedlang's kernels were imported, and still is."""
    return _INTERPRETED_AT_IMPORT and _interpret_switch()


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` are updated by the Triton kernels (else by the reference).

    CUDA tensors always are; CPU tensors only under the interpreter (that is how CI tests the
    kernels), so that an optimizer on a CPU model still works without it.
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def is_dense(*tensors: torch.Tensor | None) -> bool:
    """True when every tensor given holds its own elements, contiguous (the kernels walk memory as one flat
    range from ``data_ptr()``).

    A tensor subclass that dispatches its own ops (torchao's float8 weights, a wrapper around another tensor)
    is not: its ``data_ptr()`` may be 0 or not where its values live, so a kernel would read and write
    elsewhere. Such tensors go through the PyTorch reference, whose ops the subclass handles itself.
    """
    return all(t is None or (type(t).__torch_dispatch__ is _PLAIN_DISPATCH and t.is_contiguous()) for t in tensors)


class ChunkTables:
    """Tensor table and chunk map of one multi-tensor launch, rebuilt only when they go stale.

    ``get(rows, numels, chunk_size, device)`` returns ``(tensor_table, chunk_map, aligned)``
    (the chunk map is kept when only addresses changed):
    ``tensor_table`` is int64 ``(n, ROW_WIDTH)`` on ``device`` with ``rows[i]`` in its first
    columns and ``numels[i]`` in the last; ``chunk_map`` is int32 ``(n_chunks, 2)``; ``aligned``
    says that every non-zero address in ``rows`` is a multiple of 16 bytes, so the kernel may
    promise the compiler 16-byte vector accesses. ``rebuilds`` counts the builds (tests use it).
    """

    def __init__(self) -> None:
        self.key = None
        self.chunk_key = None
        self.tensor_table: torch.Tensor | None = None
        self.chunk_map: torch.Tensor | None = None
        self.aligned = False
        self.rebuilds = 0

    def get(self, rows, numels, chunk_size: int, device: torch.device):
        key = (chunk_size, device, tuple(rows), tuple(numels))
        if key != self.key:
            self._build(rows, numels, chunk_size, device)
            self.key = key
        return self.tensor_table, self.chunk_map, self.aligned

    def zero_column(self, column: int) -> None:
        """Set one column to 0 on the device and in the cached key (no rebuild follows)."""
        if self.tensor_table is None:
            return
        self.tensor_table[:, column].zero_()
        chunk_size, device, rows, numels = self.key
        rows = tuple(tuple(0 if i == column else v for i, v in enumerate(r)) for r in rows)
        self.key = (chunk_size, device, rows, numels)

    def _build(self, rows, numels, chunk_size: int, device: torch.device) -> None:
        n = len(rows)
        width = len(rows[0]) if n else 0
        if width > NUMEL_COLUMN:
            raise ValueError(f"a tensor row holds at most {NUMEL_COLUMN} integers, got {width}")
        # built on the host whatever torch's default device is, then copied over once
        table = torch.zeros((n, ROW_WIDTH), dtype=torch.int64, device="cpu")
        if n:
            table[:, :width] = torch.tensor(rows, dtype=torch.int64, device="cpu")
            table[:, NUMEL_COLUMN] = torch.tensor(numels, dtype=torch.int64, device="cpu")
        self.aligned = all(addr % VECTOR_BYTES == 0 for r in rows for addr in r[:width] if addr)
        self.tensor_table = _to_device(table, device)
        # the chunk map depends on the sizes only: new addresses (re-allocated gradients) keep it
        chunk_key = (chunk_size, device, tuple(numels))
        if chunk_key != self.chunk_key:
            counts = (table[:, NUMEL_COLUMN] + chunk_size - 1) // chunk_size
            tensor_index = torch.repeat_interleave(torch.arange(n, dtype=torch.int64, device="cpu"), counts)
            first_chunk = torch.cumsum(counts, 0) - counts
            chunk_index = torch.arange(tensor_index.numel(), dtype=torch.int64, device="cpu") - first_chunk[tensor_index]
            chunk_map = torch.stack([tensor_index, chunk_index], dim=1).to(torch.int32)
            self.chunk_map = _to_device(chunk_map, device)
            self.chunk_key = chunk_key
        self.rebuilds += 1
        logger.debug("built chunk tables: %d tensors, %d chunks of %d, aligned=%s",
                     n, self.chunk_map.shape[0], chunk_size, self.aligned)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # pinned + non_blocking: the copy is queued on the stream, the host does not wait for it
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
