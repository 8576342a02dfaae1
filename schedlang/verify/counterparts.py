"""Which tensor of the original model each parameter and buffer of the scheduled model stands for.

The scheduled model is the plan replayed on a copy (``base``) of the reference, so

* a tensor the plan left alone is the very object it was in ``base``;
* a shard remembers its source tensor and its slice (:func:`~schedlang.distributed.sharding.shard_source`);
* a parameter made by horizontal fusion remembers which part came from which parameter;
* a replaced module holds new tensors: one whose values equal exactly one tensor of the
  original (the replacement was built from the original's weights) is matched by value.

Anything else has no counterpart and is reported, never skipped in silence.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch

from ..distributed.sharding import shard_source

__all__ = ["Counterpart", "CounterpartFinder"]


@dataclasses.dataclass
class Counterpart:
    """One part of a scheduled tensor and the original tensor it must equal.

    ``take_local(t)`` picks the part out of the scheduled tensor (or its gradient);
    ``take_reference(t)`` picks the matching part out of the original tensor (or its gradient).
    """

    description: str
    reference_name: str
    take_local: Callable[[torch.Tensor], torch.Tensor]
    take_reference: Callable[[torch.Tensor], torch.Tensor]
    whole: bool  # the scheduled tensor is the whole original tensor (not a shard or a part)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class CounterpartFinder:
    """Maps tensors of the scheduled model back to the reference model's names.

    ``base_tensors`` are id -> name of ``base``'s parameters (or buffers) before the replay;
    ``reference_tensors`` name -> tensor of the reference model (same values as ``base``).
    """

    def __init__(self, kind: str, base_tensors: Dict[int, str], reference_tensors: Dict[str, torch.Tensor]):
        self.kind = kind
        self.base_tensors = base_tensors
        self.reference = reference_tensors
        self.claimed: set = set()

    def find(self, name: str, t: torch.Tensor) -> Optional[List[Counterpart]]:
        label = f"{self.kind} '{name}'"
        if id(t) in self.base_tensors:
            ref = self.base_tensors[id(t)]
            self.claimed.add(ref)
            return [Counterpart(label, ref, _identity, _identity, whole=True)]
        found = shard_source(t)
        if found is not None and id(found[0]) in self.base_tensors:
            src, spec = found
            ref = self.base_tensors[id(src)]
            self.claimed.add(ref)
            what = f"{label} (shard {spec.rank}/{spec.world_size} along axis {spec.axis} of '{ref}')"
            return [Counterpart(what, ref, _identity, spec.slice_of, whole=False)]
        from ..graph.passes.horizontal import fused_sources

        pieces = fused_sources(t)
        if pieces and all(id(src) in self.base_tensors for src, _ in pieces):
            out = []
            for src, part in pieces:
                ref = self.base_tensors[id(src)]
                self.claimed.add(ref)
                out.append(Counterpart(f"{label} (the part that is '{ref}')", ref, part.take, _identity, whole=False))
            return out
        return self._by_value(label, t)

    def _by_value(self, label: str, t: torch.Tensor) -> Optional[List[Counterpart]]:
        local = getattr(t, "to_local", None)
        value = (local() if callable(local) else t).detach()
        if value.numel() < 2:  # a scalar equals too many things by chance
            return None
        equal = [n for n, r in self.reference.items()
                 if r.shape == value.shape and r.dtype == value.dtype and torch.equal(r.detach().cpu(), value.cpu())]
        if len(equal) != 1:
            return None
        self.claimed.add(equal[0])
        return [Counterpart(f"{label} (matched by value to '{equal[0]}')", equal[0], _identity, _identity, whole=True)]

    def unclaimed(self) -> List[str]:
        """Names of the original's tensors that no scheduled tensor stands for."""
        return [n for n in self.reference if n not in self.claimed]
