"""``context_parallel``: what it refuses (each message pinned), the split of the inputs, the loss helper's
shift on the full sequence, its plan's JSON round trip, and the user's model left as it was."""

import copy

import pytest
import torch

import schedlang
from schedlang.distributed import context_parallel as cp
from schedlang.errors import UnsupportedModelError
from schedlang.distributed.launch import run_distributed
from tests.helpers.hf_models import llama

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_load_balanced_split_pairs_an_early_and_a_late_chunk():
    assert cp.chunk_order(2) == [[0, 3], [1, 2]]
    assert cp.local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([cp.local_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    x = torch.arange(16).view(2, 8)
    assert cp.split_sequence(x, 1, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_a_length_that_does_not_split_names_the_valid_ones():
    with pytest.raises(schedlang.ScheduleValueError) as e:
        cp.check_sequence_length(10, 2, "<root>")
    assert str(e.value) == ("<root>: a sequence of 10 tokens does not split over cp=2 ranks: the load-balanced split "
                            "cuts it into 4 equal chunks, so its length must be a multiple of 4 (e.g. 8 or 12)")


def test_loss_on_one_rank_equals_the_models_own_loss():
    model = llama()
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    tokens[0, 5] = 3
    labels = tokens.clone()
    labels[0, 4:7] = -100
    out = model(tokens, labels=labels)
    alone = cp.ContextParallelGroup(None, 1, 0)
    assert torch.allclose(cp.context_parallel_loss(out.logits, labels, alone), out.loss, rtol=1e-6, atol=1e-6)


def test_without_a_cp_dimension_it_says_how_to_make_one():
    sch = schedlang.create_schedule(llama())
    with pytest.raises(schedlang.ScheduleValueError) as e:
        sch.context_parallel()
    assert str(e.value) == ("<root>: context_parallel splits the sequence over the mesh's 'cp' dimension, and the "
                            "schedule's mesh has no mesh; create the schedule with mesh=make_mesh(cp=N, ...)")
    assert len(sch.plan) == 0


def _one_rank_checks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    found = {}

    # an attention implementation it does not reproduce
    model = llama(attn="sdpa")
    model.config._attn_implementation = "flex_attention"
    try:
        schedlang.create_schedule(model, mesh=mesh).context_parallel()
    except UnsupportedModelError as e:
        found["flex"] = str(e)

    # attention sinks (gpt-oss)
    from transformers import GptOssConfig, GptOssForCausalLM

    oss = GptOssForCausalLM(GptOssConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, intermediate_size=32, vocab_size=64,
                                         num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"]))
    oss.config._attn_implementation = "eager"
    try:
        schedlang.create_schedule(oss, mesh=mesh).context_parallel()
    except UnsupportedModelError as e:
        found["sinks"] = str(e)

    # the step: the user's model unchanged, the plan replayable from JSON, the inputs checked at run time
    user = llama()
    before = copy.deepcopy(user.state_dict())
    sch = schedlang.create_schedule(user, mesh=mesh)
    sch.context_parallel()
    found["user_impl"] = user.config._attn_implementation
    found["user_hooks"] = len(user._forward_pre_hooks)
    found["user_same"] = all(torch.equal(v, user.state_dict()[k]) for k, v in before.items())
    replayed = schedlang.replay(schedlang.Plan.from_json(sch.plan.to_json()), llama(), mesh=mesh)
    tokens = torch.randint(0, 256, (2, 10))
    found["replayed_equal"] = bool(torch.allclose(replayed.mod(tokens).logits, sch.mod(tokens).logits))
    found["equal_to_plain"] = bool(torch.allclose(sch.mod(tokens).logits, user(tokens).logits, atol=1e-5))
    for key, call in {"labels": lambda: sch.mod(tokens, labels=tokens),
                      "padding": lambda: sch.mod(tokens, attention_mask=torch.ones_like(tokens).index_fill(1, torch.tensor([0]), 0)),
                      "odd": lambda: sch.mod(tokens[:, :9]),
                      "twice": lambda: sch.context_parallel()}.items():
        try:
            call()
        except schedlang.SchedlangError as e:
            found[key] = str(e)
    return found


def test_refusals_and_the_recorded_step_on_a_one_rank_cp_mesh():
    found = run_distributed(_one_rank_checks, world_size=1, timeout=180)[0]
    assert found["flex"] == ("<root>: context_parallel cannot split this model: its attention implementation is "
                             "'flex_attention'; context parallelism reproduces 'sdpa' or 'eager' (set "
                             "config._attn_implementation)")
    assert found["sinks"] == ("model.layers.0.self_attn: context_parallel cannot split this model: attention sinks (a "
                              "learned score every query adds to its softmax) are not supported")
    assert found["user_impl"] == "sdpa" and found["user_hooks"] == 0 and found["user_same"]
    assert found["replayed_equal"] and found["equal_to_plain"]
    assert found["labels"].startswith("<root>: under context_parallel the model's own loss would shift labels")
    assert found["padding"] == ("<root>: context_parallel does not support padding: attention_mask has zeros; pass "
                                "sequences without padding (attention_mask=None or all ones)")
    assert found["odd"].startswith("<root>: a sequence of 9 tokens does not split over cp=1 ranks")
    assert found["twice"] == ("<root>: context_parallel was already applied to this model; call it once, on the "
                              "model's root")
