"""The structure of a model, recorded in a plan so that a replay can tell it has the right model.

A fingerprint lists every module of the model as one line: its path, its class name and the
shapes of the parameters it holds itself, e.g. ``layers.0.fc1 Linear weight[20,12] bias[20]``.
Class names are compared without their module, so a model class defined in a script
(``__main__``) still matches the same class imported from a package. Its ``digest`` is a short
hash of those lines.

Example::

    fp = ModelFingerprint.of(model)
    fp.check(other_model)   # PlanMismatchError naming the first difference, if any
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, Optional, Tuple

from torch import nn

from .errors import PlanMismatchError, PlanSerializationError

__all__ = ["ModelFingerprint"]


def _entry(path: str, module: nn.Module) -> str:
    params = "".join(f" {name}[{','.join(str(d) for d in p.shape)}]"
                     for name, p in module._parameters.items() if p is not None)
    return f"{path or '<root>'} {type(module).__qualname__}{params}"


def _split(entry: str) -> Tuple[str, str, Dict[str, str]]:
    path, _, rest = entry.partition(" ")
    type_name, *params = rest.split(" ")
    return path, type_name, dict(p[:-1].split("[", 1) for p in params if p.endswith("]") and "[" in p)


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """Module paths, class names and parameter shapes of a model, in module order."""

    model_type: str
    modules: Tuple[str, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "ModelFingerprint":
        return cls(type(model).__qualname__, tuple(_entry(path, m) for path, m in model.named_modules()))

    @property
    def digest(self) -> str:
        return hashlib.sha256("\n".join(self.modules).encode()).hexdigest()[:16]

    def to_dict(self) -> Dict[str, Any]:
        return {"type": self.model_type, "fingerprint": self.digest, "modules": list(self.modules)}

    @classmethod
    def from_dict(cls, data: Any) -> "ModelFingerprint":
        """Read what :meth:`to_dict` wrote; PlanSerializationError if it is malformed."""
        if not isinstance(data, dict) or not isinstance(data.get("type"), str) or not isinstance(
                data.get("modules"), list) or not all(isinstance(m, str) and " " in m for m in data["modules"]):
            raise PlanSerializationError(
                "plan: the plan's \"model\" record is malformed: expected {\"type\": str, \"fingerprint\": str, "
                "\"modules\": [\"<path> <Class> <param>[<shape>] ...\", ...]}")
        return cls(data["type"], tuple(data["modules"]))

    def first_difference(self, other: "ModelFingerprint") -> Optional[str]:
        """How ``other`` (the model at hand) first differs from this one (the plan's), or None."""
        if self.modules == other.modules:
            return None
        theirs = {_split(e)[0]: _split(e) for e in other.modules}
        mine = {_split(e)[0]: _split(e) for e in self.modules}
        for entry in self.modules:
            path, type_name, params = _split(entry)
            if path not in theirs:
                return f"'{path}' ({type_name}) is missing from this model"
            _, their_type, their_params = theirs[path]
            if their_type != type_name:
                return f"'{path}' is {type_name} in the plan's model and {their_type} here"
            for name, shape in params.items():
                if name not in their_params:
                    return f"'{path}' has no parameter '{name}' here (shape ({shape}) in the plan's model)"
                if their_params[name] != shape:
                    return (f"'{path}.{name}' has shape ({their_params[name]}) here and ({shape}) in the plan's "
                            "model")
            for name, shape in their_params.items():
                if name not in params:
                    return f"'{path}' has a parameter '{name}' (shape ({shape})) that the plan's model does not"
        for entry in other.modules:
            path, type_name, _ = _split(entry)
            if path not in mine:
                return f"this model has '{path}' ({type_name}), which the plan's model does not"
        return "the modules come in a different order"

    def check(self, model: nn.Module) -> None:
        """Raise PlanMismatchError if ``model`` is not structured like the model of this fingerprint."""
        other = ModelFingerprint.of(model)
        difference = self.first_difference(other)
        if difference is not None:
            raise PlanMismatchError(
                f"plan: the plan was made for a different model ({self.model_type}, fingerprint {self.digest}; this "
                f"{other.model_type} has {other.digest}): {difference}. Pass check_fingerprint=False to "
                "schedlang.replay to apply it anyway")
