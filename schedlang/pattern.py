"""Pattern forms for ``Schedule.find``, under Slapo's names.

``find`` accepts a regex over module names, a pattern function, or a pattern module. The
pieces here describe module calls inside patterns:

* ``call_module(regex, *args)`` in a pattern function: a call of any module whose name matches
  ``regex`` (``re.search`` on its path within the traced module);
* :class:`Pattern`: subclass it and write ``forward`` to give a pattern with submodules
  (``nn.BatchNorm2d`` and ``nn.ReLU`` match modules of those types whatever their sizes);
* :class:`ModulePattern` ``(regex)``: a submodule of a :class:`Pattern` standing for any module
  whose name matches ``regex``.

Matching is by dataflow, in :mod:`schedlang.graph.pattern`.

Example::

    from schedlang.pattern import Pattern, ModulePattern, call_module

    class LinearReLU(Pattern):
        def __init__(self):
            super().__init__()
            self.fc = ModulePattern(r"fc\\d?")
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.fc(x))

    sch.trace()
    sch.find(LinearReLU())                                   # one subgraph per fc -> relu
    sch.find(lambda x: F.relu(call_module(r"fc\\d?", x)))    # the same
"""

from __future__ import annotations

from torch import nn

from .errors import PatternError
from .graph.canonical import call_module, check_regex

__all__ = ["Pattern", "ModulePattern", "call_module"]


class Pattern(nn.Module):
    """Base class of pattern modules: define the submodules in ``__init__`` and the computation
    to find in ``forward``; pass an instance to ``Schedule.find``."""

    def forward(self, *args):
        raise PatternError(f"find: {type(self).__name__} is a Pattern: define forward(self, x, ...) with the "
                           "computation to find; it is traced by Schedule.find, not run")


class ModulePattern(nn.Module):
    """Inside a :class:`Pattern`: a call of any module whose name matches the regex ``name``."""

    def __init__(self, name: str):
        super().__init__()
        check_regex(name, "ModulePattern")
        self.name = name

    def forward(self, *args, **kwargs):
        # traced (not a leaf: it lives outside torch.nn), so this records the call_module marker
        return call_module(self.name, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"
