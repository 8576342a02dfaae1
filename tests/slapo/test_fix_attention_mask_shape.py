"""``fix_attention_mask_shape``: after the heads of an attention are split over the ranks, a traced
``mask.expand(B, H, S, S)`` must expand to this rank's ``H / world`` heads. Checked on two gloo ranks
inside Verify (outputs and gradients against the unsharded module), and on one rank (nothing to do)."""

from unittest import mock

import pytest
import torch
from torch import nn

import schedlang.distributed.groups as groups

import schedlang as slapo
from schedlang.model_schedule import bert, opt
from tests.helpers.distributed import run_distributed


class MaskedHeadMix(nn.Module):
    """Mixes each head's values over the positions a (B, 1, 1, S) mask keeps, the mask expanded to
    every head as pre-kernel attention code did."""

    def __init__(self, hidden: int = 12, heads: int = 4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, mask):
        b, s = x.size(0), x.size(1)
        values = self.value(x).view(b, s, -1, self.head_dim).transpose(1, 2)   # (B, heads here, S, D)
        weights = mask.to(x.dtype).expand(b, self.heads, s, s)                  # (B, H, S, S)
        mixed = torch.matmul(weights, values).transpose(1, 2).reshape(b, s, -1)
        return self.out(mixed)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MaskedHeadMix()

    def forward(self, x, mask):
        return self.attn(x, mask) + x


def _inputs():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 12, generator=gen)
    mask = (torch.rand(3, 1, 1, 5, generator=gen) > 0.3).long()   # a padding mask: data, never trained
    return x, mask


def _mask_on_two_ranks(rank, world):
    torch.manual_seed(0)
    model = Block()
    x, mask = _inputs()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_inputs=[x, mask]):
        attn = sch["attn"]
        attn["value"].shard("weight", axis=0)
        attn["value"].shard("bias", axis=0)
        attn["value"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        attn["out"].shard("weight", axis=1)
        attn["out"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        fixed = opt.fix_attention_mask_shape(attn)
    expands = [node.args[1:] for _, node in attn.find_node(lambda n: n.op == "call_method" and n.target == "expand")]
    return fixed, len(expands)


def test_fix_attention_mask_shape_expands_to_the_local_heads_on_two_ranks():
    results = run_distributed(_mask_on_two_ranks, world_size=2, timeout=300)
    # one expand rewritten on each rank, and no expand of the full head count left in the graph
    assert results == [(1, 0), (1, 0)]


def test_fix_attention_mask_shape_does_nothing_on_one_rank():
    torch.manual_seed(0)
    model = Block()
    x, mask = _inputs()
    sch = slapo.create_schedule(model)
    assert bert.fix_attention_mask_shape(sch["attn"]) == 0
    built, _ = slapo.build(sch, init_weights=False)
    torch.testing.assert_close(built(x, mask), model(x, mask))


def test_fix_attention_mask_shape_refuses_heads_that_do_not_split_and_changes_nothing():
    sch = slapo.create_schedule(Block())
    sch["attn"].trace()
    code = sch["attn"].mod.code
    with mock.patch.object(groups, "world_size", lambda group=None: 3), \
            mock.patch.object(groups, "rank", lambda group=None: 0):
        with pytest.raises(slapo.errors.ScheduleValueError,
                           match=r"^attn: fix_attention_mask_shape: 'expand' expands to 4 heads, which do not split "
                                 r"over 3 ranks; valid head counts are multiples of 3$"):
            opt.fix_attention_mask_shape(sch["attn"])
    assert sch["attn"].mod.code == code
