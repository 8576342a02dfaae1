"""Debugging helpers: :class:`Print`."""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["Print"]


class Print(nn.Module):
    """``print(*values)`` when the module runs, returning its first argument unchanged.

    It stays one ``call_module`` node when its parent is traced, so it prints at run time, not
    at trace time; give the values lazily (``self.print(x, "x shape", x.shape)``, not
    ``f"{x}"``, which would be formatted while tracing). Meant for debugging: it writes to
    ``file`` (stdout by default).

    Example::

        out = self.print(out, "after fc:", out.shape)
    """

    def __init__(self):
        super().__init__()
        self.traceable = False
        # a forward set on the instance keeps the module a leaf for schedlang's tracer
        self.forward = self._print

    def _print(self, out: torch.Tensor, *values, sep: str = " ", end: str = "\n", file=None, flush: bool = True):
        print(*values, sep=sep, end=end, file=file if file is not None else sys.stdout, flush=flush)
        return out
