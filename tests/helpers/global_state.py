"""Process-wide state a test must leave as it found it, and a guard that names the test that did not.

A test that changes torch's compiler configuration (say ``torch._dynamo.config.recompile_limit``) and
does not put it back breaks every later ``torch.compile`` in the same process, and the failure shows up
minutes later in an unrelated file. The guard snapshots that state before each test and compares it
after, so the polluting test itself fails, with the keys it changed; the state is then restored, so
the tests after it run as they would have.

Random number generators are different: drawing numbers is what tests do, so their state is restored
after each test rather than compared (each test also starts from ``torch.manual_seed(0)``).
"""

import random
import warnings
from typing import Any, Dict, List, Tuple

import torch

# A config key whose value cannot be read any more: ``delattr`` on a torch config module hides the key,
# and reading it raises AttributeError (pytest's monkeypatch undo does exactly that since pytest 9.1).
_UNREADABLE = "<unreadable: the option was deleted>"


def _config_modules() -> List[Any]:
    """torch's compiler configuration modules: Dynamo's, Inductor's and AOT autograd's."""
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    return [torch._dynamo.config, torch._inductor.config, torch._functorch.config]


def _read_config(module) -> Dict[str, Any]:
    values = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated options warn when read
        for key in module.get_config_copy():
            try:
                values[key] = getattr(module, key)
            except AttributeError:
                values[key] = _UNREADABLE
    return values


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values that do not compare (tensors, odd objects): compare identities
        return a is b


class GlobalState:
    """What the process looked like when the snapshot was taken."""

    def __init__(self):
        self.configs = {module.__name__: (module, _read_config(module)) for module in _config_modules()}
        self.default_dtype = torch.get_default_dtype()
        self.default_device = torch.get_default_device()
        self.grad_enabled = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = _numpy_state()

    def changes(self) -> List[str]:
        """What differs now from the snapshot, one readable line per change."""
        found = []
        for name, (module, before) in self.configs.items():
            after = _read_config(module)
            for key in sorted(set(before) | set(after)):
                old, new = before.get(key, _UNREADABLE), after.get(key, _UNREADABLE)
                if not _same(old, new):
                    found.append(f"{name}.{key}: {old!r} -> {new!r}")
        for label, old, new in self._scalars():
            if old != new:
                found.append(f"{label}: {old!r} -> {new!r}")
        return found

    def _scalars(self) -> List[Tuple[str, Any, Any]]:
        return [
            ("torch.get_default_dtype()", self.default_dtype, torch.get_default_dtype()),
            ("torch.get_default_device()", self.default_device, torch.get_default_device()),
            ("torch.is_grad_enabled()", self.grad_enabled, torch.is_grad_enabled()),
            ("torch.are_deterministic_algorithms_enabled()", self.deterministic,
             torch.are_deterministic_algorithms_enabled()),
            ("torch.is_anomaly_enabled()", self.anomaly, torch.is_anomaly_enabled()),
        ]

    def restore(self) -> None:
        """Put everything back: the configs key by key, the defaults, and every random generator."""
        for module, before in self.configs.values():
            after = _read_config(module)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for key, value in before.items():
                    if not _same(value, after.get(key, _UNREADABLE)) and value is not _UNREADABLE:
                        setattr(module, key, value)  # also un-hides a deleted option
        torch.set_default_dtype(self.default_dtype)
        torch.set_default_device(self.default_device)
        torch.set_grad_enabled(self.grad_enabled)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.autograd.set_detect_anomaly(self.anomaly)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        if self.numpy_rng is not None:
            import numpy

            numpy.random.set_state(self.numpy_rng)


def _numpy_state():
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()
