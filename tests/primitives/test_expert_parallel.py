"""The expert_parallel primitive in one process (a group of one rank): the family's numerics unchanged,
the plan replayable from JSON, bad targets refused. The multi-rank numerics are in
tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import schedlang
from schedlang.distributed.expert_parallel import ExpertParallelExperts, expert_parameters
from schedlang.errors import ScheduleValueError, UnsupportedModelError
from tests.helpers.moe_models import FAMILIES, rank_batches, tiny_model

pytest.importorskip("transformers")


def _top_k(model) -> int:
    config = model.config
    return int(getattr(config, "num_experts_per_tok", None) or getattr(config, "num_experts_per_token", None))


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch, labels=batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_keeps_the_family_numerics(family):
    original = tiny_model(family)
    reference = copy.deepcopy(original)
    sch = schedlang.create_schedule(original)
    sch.expert_parallel()
    spread = [m for m in sch.mod.modules() if isinstance(m, ExpertParallelExperts)]
    assert spread and all(m.local_experts == m.total_experts for m in spread)
    assert not any(isinstance(m, ExpertParallelExperts) for m in original.modules())  # the user's model unchanged
    batch = rank_batches(2)[1]
    got, got_grads = _run(sch.mod, batch)
    want, want_grads = _run(reference, batch)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    if want.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss, want.aux_loss)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    spread_weights = expert_parameters(sch.mod)
    assert spread_weights["model.layers.1.mlp.experts.down_proj"][:2] == (1, 0)
    # each block counts the (token, choice) rows its experts received: the router's own choices, counted
    for block in spread:
        assert block.tokens_per_expert is not None and block.tokens_per_expert.shape == (block.total_experts,)
        assert int(block.tokens_per_expert.sum()) == batch.numel() * _top_k(sch.mod)
    assert set(spread_weights) == {n for n in want_grads if ".experts." in n and "shared" not in n}


def test_plan_replays_from_json():
    sch = schedlang.create_schedule(tiny_model("qwen3_moe"))
    sch.expert_parallel()
    text = sch.plan.to_json()
    assert '"expert_parallel"' in text
    again = schedlang.replay(text, tiny_model("qwen3_moe"))
    paths = [p for p, m in again.mod.named_modules() if isinstance(m, ExpertParallelExperts)]
    assert paths == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    batch = rank_batches(1)[0]
    torch.testing.assert_close(again.mod(batch).logits, sch.mod(batch).logits)


def test_refuses_a_module_without_experts():
    sch = schedlang.create_schedule(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ScheduleValueError, match=r"<root>: expert_parallel found no mixture-of-experts block under "
                                                 r"Sequential: valid targets hold an experts module with 3-D "
                                                 r"gate_up_proj/down_proj tensors"):
        sch.expert_parallel()
    assert len(sch.plan) == 0


class _ListMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2)])


def test_refuses_experts_kept_as_a_module_list():
    sch = schedlang.create_schedule(nn.Sequential(_ListMoE()))
    with pytest.raises(UnsupportedModelError, match=r"<root>: expert_parallel supports experts kept as 3-D tensors "
                                                    r"in one module \(transformers 5.x\); 0.experts is an "
                                                    r"nn.ModuleList of separate expert MLPs"):
        sch.expert_parallel()


def test_refuses_a_mesh_dimension_without_a_mesh():
    sch = schedlang.create_schedule(tiny_model("mixtral"))
    with pytest.raises(ScheduleValueError, match=r"<root>: expert_parallel group 'ep' is not a dimension of the "
                                                 r"schedule's mesh; valid dimension names: none \(the schedule was "
                                                 r"made without mesh=\)"):
        sch.expert_parallel("ep")


def test_one_layer_then_the_rest_then_nothing_left():
    sch = schedlang.create_schedule(tiny_model("olmoe"))
    sch["model.layers.1"].expert_parallel()
    spread = [p for p, m in sch.mod.named_modules() if isinstance(m, ExpertParallelExperts)]
    assert spread == ["model.layers.1.mlp.experts"]
    sch.expert_parallel()  # finds the block not spread yet
    with pytest.raises(ScheduleValueError, match=r"<root>: expert_parallel: the experts under OlmoeForCausalLM are "
                                                 r"spread already \(model.layers.0.mlp.experts, "
                                                 r"model.layers.1.mlp.experts\); a block's experts are spread once"):
        sch.expert_parallel()
    assert [s.primitive for s in sch.plan.steps] == ["expert_parallel", "expert_parallel"]
