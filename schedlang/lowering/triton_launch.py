"""Launching one generated Triton kernel: block sizes and warps (a heuristic, timed choices on
large CUDA grids), the grid, and on CUDA a direct call of the binary the JIT returned first."""

from __future__ import annotations

import logging
import os

import torch

from .translate import Specialization

logger = logging.getLogger("schedlang.lowering.triton")

#: (kernel, function, rows, columns, device) -> the timed (BLOCK_R, BLOCK_N, num_warps)
_TUNED: dict[tuple, tuple] = {}
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
    """One generated kernel with its launch logic.

    On CUDA the first launch for a given argument specialization goes through Triton's JIT
    (``fn[grid](...)``), which compiles or fetches the binary and returns it; later launches
    with the same specialization call that binary's launcher directly. That skips the JIT's
    per-call work (binding the arguments to the signature, hashing the specialization,
    reading options and launch hooks), which costs more host time than the kernels of a
    fused pointwise op take on the GPU. The key of a binary holds everything the JIT
    specializes on: each tensor's dtype and 16-byte alignment, the integer arguments
    (sizes and strides; for the dropout seed whether it is 1 or a multiple of 16), the
    launch constants and the current device.
    """

    def __init__(self, plan, fn, spec: Specialization, interpret: bool):
        self.plan, self.fn, self.spec, self.interpret = plan, fn, spec, interpret
        self._chosen: dict = {}  # device -> (config, grid)
        self._binaries: dict = {}  # specialization key -> compiled kernel
        # False when the JIT does not return a launchable binary (or SCHEDLANG_DIRECT_LAUNCH=0)
        self._direct = not interpret and os.environ.get("SCHEDLANG_DIRECT_LAUNCH", "1") != "0"

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

    def chosen(self, build_args, device) -> tuple:
        """``((BLOCK_R, BLOCK_N, num_warps), grid)`` for ``device``; the first call picks
        them (timing candidates with ``build_args(grid) -> (args, finish)`` where tuned)."""
        chosen = self._chosen.get(device)
        if chosen is None:
            config = self._choose(build_args, device)
            chosen = self._chosen[device] = (config, self.grid_and_programs(config[0], config[1], device, config[2]))
        return chosen

    def launch(self, build_args, device):
        """``build_args(grid)`` returns (positional args, post-processing callback)."""
        config, grid = self.chosen(build_args, device)
        args, finish = build_args(grid)
        self.call(grid, args, config)
        return finish()

    def call(self, grid, args: list, config: tuple):
        """Launch on ``grid`` with the kernel's positional ``args`` (without the constants)."""
        br, bn, warps = config
        if self.interpret:
            self._launch_interpreted(grid, args, br, bn, warps)
            return
        if self._direct and _launch_hooks_idle(self.fn):
            device = _current_device()
            key = self._binary_key(device, args, config)
            binary = self._binaries.get(key)
            if binary is not None:
                # what the JIT does once it has the binary (no launch hooks are installed)
                try:
                    binary.run(grid[0], grid[1], 1, _current_stream(device), binary.function,
                               binary.packed_metadata, None, None, None, *args, br, bn)
                    return
                except Exception as exc:  # a launcher of another form: launch through the JIT from now on
                    logger.debug("direct launch of %s failed (%s); launching through the JIT",
                                 self.plan.kernel_name, exc)
                    self._direct = False
            binary = self.fn[grid](*args, BLOCK_R=br, BLOCK_N=bn, num_warps=warps)
            if all(hasattr(binary, a) for a in ("run", "function", "packed_metadata")):
                self._binaries[key] = binary
            else:  # another Triton: always launch through the JIT
                self._direct = False
            return
        self.fn[grid](*args, BLOCK_R=br, BLOCK_N=bn, num_warps=warps)

    def _binary_key(self, device: int, args: list, config: tuple) -> tuple:
        key = [device, config]
        for a in args:
            if type(a) is int:
                key.append(a)
            else:
                key.append(a.dtype)
                key.append(a.data_ptr() % 16 == 0)
        if self.plan.uses_seed:  # the seed changes at every call: keep what the JIT specializes on
            seed = key[-1]
            key[-1] = (seed == 1, seed % 16 == 0, seed < 2 ** 31)
        return tuple(key)

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
            self._launch_interpreted(grid, args, br, bn, warps)
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


_RUNTIME_KNOBS = None


def _launch_hooks_idle(fn) -> bool:
    """True when nothing observes launches (profilers install launch hooks), so a binary's
    launcher may be called without them."""
    global _RUNTIME_KNOBS
    if getattr(fn, "pre_run_hooks", None):
        return False
    if _RUNTIME_KNOBS is None:
        try:
            from triton import knobs

            _RUNTIME_KNOBS = knobs.runtime
        except ImportError:  # no knobs module: no direct launches
            return False
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)
