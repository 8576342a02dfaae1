"""Which tensor of the original model each parameter and buffer of the scheduled model stands for.

The scheduled model is the plan replayed on a copy (``base``) of the reference, so

* a tensor the plan left alone is the very object it was in ``base``;
* a shard remembers its source tensor and its slice (:func:`~schedlang.distributed.sharding.shard_source`);
* a parameter made by horizontal fusion remembers which part came from which parameter;
* a replaced module holds new tensors: one with the name of an original tensor and its value,
  or whose value equals exactly one tensor of the original (the replacement was built from
  the original's weights), is matched by value. Values are those before the models ran
  (running statistics change as they run);
* an expert-parallel block's weights are this rank's slice of its experts (``expert_parallel``, see
  :mod:`schedlang.verify.expert_split`), matched by name.

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
    # an expert-parallel rank's slice of experts: its gradient is that of the group's summed losses
    summed_over_group: bool = False


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class CounterpartFinder:
    """Maps tensors of the scheduled model back to the reference model's names.

    ``base_tensors`` are id -> name of ``base``'s parameters (or buffers) before the replay;
    ``reference_tensors`` name -> tensor of the reference model; ``initial_values`` name -> value of
    each reference tensor before the models ran (default: the tensors themselves).
    """

    def __init__(self, kind: str, base_tensors: Dict[int, str], reference_tensors: Dict[str, torch.Tensor],
                 initial_values: Optional[Dict[str, torch.Tensor]] = None, experts=None):
        self.experts = experts  # the scheduled model's ExpertSplit, if any
        self.kind = kind
        self.base_tensors = base_tensors
        self.reference = reference_tensors
        self.initial = initial_values if initial_values is not None else reference_tensors
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
        spread = self.experts.counterpart_of(name, self.reference) if self.experts is not None else None
        if spread is not None:
            ref, start, count, rank, size = spread
            self.claimed.add(ref)
            what = (f"{label} (experts {start}..{start + count - 1} of '{ref}', expert-parallel rank {rank} of {size})")
            return [Counterpart(what, ref, _identity, lambda full: full.narrow(0, start, count), whole=False,
                                summed_over_group=size > 1)]
        from ..graph.passes.horizontal import fused_sources

        pieces = fused_sources(t)
        if pieces and all(id(src) in self.base_tensors for src, _ in pieces):
            out = []
            for src, part in pieces:
                ref = self.base_tensors[id(src)]
                self.claimed.add(ref)
                out.append(Counterpart(f"{label} (the part that is '{ref}')", ref, part.take, _identity, whole=False))
            return out
        return self._by_value(name, label, t)

    def _by_value(self, name: str, label: str, t: torch.Tensor) -> Optional[List[Counterpart]]:
        local = getattr(t, "to_local", None)
        value = (local() if callable(local) else t).detach().cpu()

        def same(ref: torch.Tensor) -> bool:
            return ref.shape == value.shape and ref.dtype == value.dtype and torch.equal(ref.detach().cpu(), value)

        if name in self.initial and same(self.initial[name]):
            self.claimed.add(name)
            return [Counterpart(f"{label} (matched by name and value)", name, _identity, _identity, whole=True)]
        if value.numel() < 2:  # a scalar equals too many things by chance
            return None
        equal = [n for n, r in self.initial.items() if same(r)]
        if len(equal) != 1:
            return None
        self.claimed.add(equal[0])
        return [Counterpart(f"{label} (matched by value to '{equal[0]}')", equal[0], _identity, _identity, whole=True)]

    def unclaimed(self) -> List[str]:
        """Names of the original's tensors that no scheduled tensor stands for."""
        return [n for n in self.reference if n not in self.claimed]
