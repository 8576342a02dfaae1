"""Verify on a schedule with expert parallelism (``expert_parallel``).

Under expert parallelism each rank of the group runs its own tokens; a mixture-of-experts block sends
them to the ranks holding their experts and back (:mod:`schedlang.distributed.expert_parallel`). So:

* every rank's outputs and input gradients are those of its own tokens, compared with the original's on
  the same tokens;
* a parameter outside the experts (attention, router, shared expert) holds the gradient of this rank's
  loss alone: compared with the original's gradient on this rank's tokens;
* a rank's slice of a block's experts holds the gradient of the *sum* of the group's losses: compared
  with the same slice of the original's expert gradient summed over the group (each rank computes the
  original's gradient on its own tokens; :meth:`ExpertSplit.summed_gradients` all-reduces it).

Verify gives every rank rank 0's inputs. So that the all-to-all moves different tokens from each rank
(a token sent back to the wrong rank would go unnoticed if all ranks held the same ones), the ranks of an
expert-parallel group then each take the batch rolled by their rank in the group (:meth:`own_tokens`):
the batch's row ``i`` becomes row ``(i + ep_rank) % batch`` of every tensor input. That needs a batch of
more than one row in every tensor input, and a schedule that splits nothing else (tensor or context
parallelism need the same tokens on the ranks that share a layer, which this cannot know); otherwise all
ranks keep the same tokens, and the report says so.

Beside tensor and sequence parallelism (experts kept whole by ``shard_model(sch, sequence_parallel=True)``,
spread over the data-parallel ranks of each tp rank) every rank keeps rank 0's tokens; each tp rank routes
its sequence slice, and the spread module sums its slice's gradient over the tp ranks, so the comparison
with the original's gradient summed over the expert-parallel group holds as it is.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import groups
from ..distributed.expert_parallel import ExpertParallelExperts
from ..distributed.sharding import shard_source

__all__ = ["ExpertSplit"]


class ExpertSplit:
    """The expert-parallel blocks of a scheduled model, as Verify needs them."""

    def __init__(self, scheduled: nn.Module):
        self.blocks: List[Tuple[str, ExpertParallelExperts]] = [
            (path, m) for path, m in scheduled.named_modules() if isinstance(m, ExpertParallelExperts)]
        # parameter name (the same in the original) -> (block, the block's own name for it)
        self.slices: Dict[str, Tuple[ExpertParallelExperts, str]] = {}
        for path, block in self.blocks:
            for name in block.expert_weight_shapes:
                self.slices[f"{path}.{name}" if path else name] = (block, name)
        self.rolled = 0  # the batch shift this rank's inputs got (0: rank 0's inputs as they are)
        self.same_tokens_why: Optional[str] = None
        self._scheduled = scheduled

    @property
    def spread(self) -> bool:
        """Some block's experts are spread over more than one rank."""
        return any(block.ep_size > 1 for _, block in self.blocks)

    @property
    def distinct_inputs(self) -> bool:
        """Ranks of this verification may hold different tokens (so tensors are not replicated across ranks)."""
        return self.spread and self.same_tokens_why is None

    # ---------------------------------------------------------------- each rank its own tokens
    def _why_same_tokens(self, tensors: Sequence[torch.Tensor]) -> Optional[str]:
        ranks_of = {(block.ep_size, block.ep_rank, id(block.ep_group)) for _, block in self.blocks}
        if len(ranks_of) != 1:
            return "the blocks' experts are spread over different groups"
        if any(shard_source(p) is not None for p in self._scheduled.parameters()) or getattr(
                self._scheduled, "_schedlang_context_parallel", None) is not None:
            return "the schedule also splits layers over ranks, which need the same tokens"
        batch = {t.shape[0] if t.dim() else 0 for t in tensors}
        if not tensors or len(batch) != 1 or min(batch) < 2:
            return "the example inputs do not all have one batch dimension of two or more rows"
        return None

    def own_tokens(self, args: List[Any], kwargs: Dict[str, Any]) -> Tuple[List[Any], Dict[str, Any]]:
        """Rank 0's inputs with the batch rolled by this rank's place in the expert-parallel group (see the
        module docstring); unchanged where that is not possible or not needed."""
        if not self.spread:
            return args, kwargs
        tensors = [x for x in list(args) + list(kwargs.values()) if isinstance(x, torch.Tensor)]
        self.same_tokens_why = self._why_same_tokens(tensors)
        if self.same_tokens_why is not None:
            return args, kwargs
        block = self.blocks[0][1]
        self.rolled = block.ep_rank % tensors[0].shape[0]

        def roll(x):
            return x.roll(-self.rolled, 0) if isinstance(x, torch.Tensor) and self.rolled else x

        return [roll(x) for x in args], {k: roll(v) for k, v in kwargs.items()}

    def note(self) -> Optional[str]:
        if not self.spread:
            return None
        sizes = sorted({block.ep_size for _, block in self.blocks})
        head = (f"expert_parallel (ep={', '.join(map(str, sizes))}): outputs and non-expert gradients compared with "
                "the original's on this rank's tokens; each rank's expert slice's gradient with the same slice of the "
                "original's gradient summed over the expert-parallel group")
        if self.same_tokens_why is not None:
            return f"{head}; every rank ran rank 0's tokens ({self.same_tokens_why})"
        return f"{head}; this rank's tokens: rank 0's batch rolled by {self.rolled} rows"

    # ---------------------------------------------------------------- gradients
    def summed_gradients(self, reference: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
        """name -> the original's gradient of each spread expert weight summed over its expert-parallel group
        (None where no rank has one). A collective: every rank calls it at the same point."""
        if not self.spread:
            return {}
        params = dict(reference.named_parameters())
        out: Dict[str, Optional[torch.Tensor]] = {}
        for name in sorted(self.slices):
            block, _ = self.slices[name]
            param = params.get(name)
            if param is None or block.ep_size == 1:
                continue
            grad = param.grad
            present = torch.tensor([0 if grad is None else 1])
            summed = torch.zeros_like(param) if grad is None else grad.detach().clone()
            dist.all_reduce(present, group=block.ep_group)
            dist.all_reduce(summed, group=block.ep_group)
            out[name] = summed if int(present) else None
        return out

    def counterpart_of(self, name: str, reference_names) -> Optional[Tuple[str, int, int, int, int]]:
        """(reference name, start, count, ep rank, ep size) of a spread expert weight, else None."""
        found = self.slices.get(name)
        if found is None or name not in reference_names:
            return None
        block, _ = found
        return name, block.ep_rank * block.local_experts, block.local_experts, block.ep_rank, block.ep_size
