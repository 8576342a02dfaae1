"""The call a traced forward is specialized on: which arguments are graph inputs, which are baked in."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch.fx import PH

from ...errors import TraceError
from .common import _P, UNKNOWN, _constant_key, _holds_tensor, forward_parameters
from .hf_bridge import _RUNTIME_FLAG_DEFAULTS, _synthesize_example


@dataclasses.dataclass
class CallSpec:
    """How one ``forward`` is traced: which parameters are graph inputs (with an example
    value, or :data:`UNKNOWN`) and which are specialized constants."""

    params: List[inspect.Parameter]
    values: Dict[str, Tuple[bool, Any]]
    var_args: List[Tuple[bool, Any]] = dataclasses.field(default_factory=list)
    var_kwargs: Dict[str, Tuple[bool, Any]] = dataclasses.field(default_factory=dict)

    def input_names(self) -> List[str]:
        return [n for n, (is_input, _) in self.values.items() if is_input]

    def key(self):
        """What two calls must share to use the same traced graph."""
        def k(entry):
            is_input, v = entry
            return ("input",) if is_input else ("const", _constant_key(v))

        return (tuple((n, k(e)) for n, e in self.values.items()), tuple(k(e) for e in self.var_args),
                tuple(sorted((n, k(e)) for n, e in self.var_kwargs.items())))

    @classmethod
    def from_call(cls, module: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any],
                  example_of: Callable[[Any], Any]) -> "CallSpec":
        """Spec of one recorded call: values holding tensors or proxies become inputs."""
        params = forward_parameters(module)
        sig = inspect.Signature(params)
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TraceError(f"trace: {type(module).__name__}.forward{sig} cannot take the arguments it was called with: "
                             f"{e}; call it with arguments that match its signature") from e
        bound.apply_defaults()
        spec = cls(params=params, values={})
        for p in params:
            value = bound.arguments.get(p.name)
            if p.kind is _P.VAR_POSITIONAL:
                spec.var_args = [(_holds_tensor(v), example_of(v) if _holds_tensor(v) else v) for v in value or ()]
            elif p.kind is _P.VAR_KEYWORD:
                spec.var_kwargs = {k: (_holds_tensor(v), example_of(v) if _holds_tensor(v) else v)
                                   for k, v in (value or {}).items()}
            else:
                spec.values[p.name] = (True, example_of(value)) if _holds_tensor(value) else (False, value)
        return spec

    @classmethod
    def from_signature(cls, module: nn.Module, concrete_args: Optional[Dict[str, Any]] = None,
                       make_example: Optional[Callable[[torch.Tensor], Any]] = None,
                       unlisted_are_inputs: bool = False,
                       recorded: Optional[Dict[str, Any]] = None) -> "CallSpec":
        """Spec from ``forward``'s signature (see the module docstring for the policy).

        ``unlisted_are_inputs``: torch.fx's own rule, which Slapo's tracers follow: with
        ``concrete_args`` given, every parameter *not* named there is a graph input, in the
        signature's order. ``recorded`` holds the values of a recorded call (:func:`capture_call`),
        used as those inputs' examples."""
        unlisted_are_inputs = unlisted_are_inputs and concrete_args is not None
        recorded = recorded or {}
        concrete_args = dict(concrete_args or {})
        make_example = make_example or (lambda t: t)
        params = forward_parameters(module)
        names = {p.name for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}
        main_inputs = set(getattr(module, "_schedlang_input_names", ()) or ())
        main = getattr(module, "main_input_name", None)
        if isinstance(main, str):
            main_inputs.add(main)
        spec = cls(params=params, values={})

        def given(value):
            if value is PH or isinstance(value, fx._symbolic_trace.PHBase):
                return True, UNKNOWN
            if isinstance(value, torch.Tensor):
                return True, make_example(value)
            return False, value

        for p in params:
            if p.kind is _P.VAR_POSITIONAL:
                continue
            if p.kind is _P.VAR_KEYWORD:
                spec.var_kwargs = {k: given(v) for k, v in concrete_args.items() if k not in names}
                continue
            if p.name in concrete_args:
                is_input, example = given(concrete_args[p.name])
                if is_input and example is UNKNOWN:
                    example = _synthesize_example(module, p.name, make_example)
                spec.values[p.name] = (is_input, example)
            elif p.default is _P.empty or p.name in main_inputs or unlisted_are_inputs:
                value = recorded.get(p.name)
                if isinstance(value, torch.Tensor):
                    example = make_example(value)
                else:
                    example = _synthesize_example(module, p.name, make_example)
                spec.values[p.name] = (True, example)
            elif p.name in _RUNTIME_FLAG_DEFAULTS and p.default is None:
                spec.values[p.name] = (False, _RUNTIME_FLAG_DEFAULTS[p.name])
            else:
                spec.values[p.name] = (False, p.default)
        return spec


