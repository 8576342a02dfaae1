"""Verify's hint when every gradient is the original's times one factor: found with a hand-written Slapo-style
tensor-parallel schedule whose LM head's gather sums a replicated gradient over the ranks, absent for a bug that
is no common factor."""

import pytest
import torch

import schedlang
from schedlang.plan import Step
from schedlang.verify.uniform_factor import GradientScales
from tests.helpers.distributed import run_distributed


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _slapo_style_tensor_parallel(sch, all_reduce_at_layer_0=True, **head_gather_options):
    """Megatron's MLP split by hand, and the LM head split along the vocabulary and gathered (its input's
    gradient, partial on each rank, all-reduced)."""
    for i in range(2):
        mlp = sch[f"model.layers.{i}.mlp"]
        mlp["gate_proj"].shard("weight", axis=0)
        mlp["up_proj"].shard("weight", axis=0)
        mlp["down_proj"].shard("weight", axis=1)
        mlp["down_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if i > 0 or all_reduce_at_layer_0:
            mlp.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["lm_head"].shard("weight", axis=0)
    sch["lm_head"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, **head_gather_options)
    sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def _schedules(rank, world):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    fixed = dict(tensor_parallel_output_grad=False)
    out = {}
    for name, options in [("default_gather", {}), ("replicated_gather", fixed),
                          # the first MLP's input gradient left partial: the gradients upstream of it are
                          # off, those downstream are right
                          ("partial_at_layer_0", dict(fixed, all_reduce_at_layer_0=False))]:
        sch = schedlang.create_schedule(_llama())
        try:
            with schedlang.Verify(sch, example_inputs=[ids], check_training=False):
                _slapo_style_tensor_parallel(sch, **options)
            out[name] = None
        except schedlang.VerificationError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_schedules, world_size=2, timeout=600)


def test_a_gather_that_sums_the_loss_gradient_is_named_as_a_factor_of_the_world_size(world2):
    for r in world2:
        message = r["default_gather"]
        assert message is not None
        hint = [line for line in message.splitlines() if "hint:" in line]
        assert hint == [
            "  hint: every gradient is 2 times the original's (21 nonzero gradients, one common factor; the outputs "
            "agree): the world size, 2. A gradient every rank already held whole was summed over the ranks: an "
            "all_gather in forward with tensor_parallel_output_grad=True (the default; its backward reduce-scatters) "
            "whose output is consumed whole on every rank, as by a loss, needs tensor_parallel_output_grad=False; "
            "or a bwd_post all_reduce is applied twice; sync steps that could do it: "
            "#4 sync at 'model.layers.0.mlp' (mode='bwd_post', sync_op_or_fn='all_reduce'), "
            "#9 sync at 'model.layers.1.mlp' (mode='bwd_post', sync_op_or_fn='all_reduce'), "
            "#11 sync at 'lm_head' (mode='fwd_post', sync_op_or_fn='all_gather', axis=-1), "
            "#12 sync at 'lm_head' (mode='bwd_post', sync_op_or_fn='all_reduce') (rank 0)"]
        # the element differences are still listed
        assert "gradient of parameter 'model.embed_tokens.weight'" in message


def test_the_suggested_fix_passes(world2):
    for r in world2:
        assert r["replicated_gather"] is None


def test_gradients_off_by_no_common_factor_get_no_factor_hint(world2):
    for r in world2:
        message = r["partial_at_layer_0"]
        assert message is not None
        assert "gradient of parameter 'model.embed_tokens.weight'" in message  # upstream of the first MLP
        assert "gradient of parameter 'model.norm.weight'" not in message  # downstream: right
        assert "times the original's" not in message


def _scales(pairs, failed=None):
    scales = GradientScales()
    for i, (actual, expected) in enumerate(pairs):
        scales.add(f"g{i}", actual, expected, 0.0, True if failed is None else failed[i])
    return scales


def test_a_common_factor_is_found_through_rounding_noise_and_zero_gradients():
    g = torch.Generator().manual_seed(0)
    expected = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g), torch.zeros(4)]
    actual = [e * 2 + 1e-4 * torch.randn(e.shape, generator=g) for e in expected[:2]] + [torch.zeros(4)]
    assert _scales(zip(actual, expected)).common_factor(3) == pytest.approx(2.0, rel=1e-3)
    # a zero gradient where the original has one tells no factor either
    assert _scales(zip(actual[:2] + [torch.zeros(4)], expected[:2] + [torch.ones(4)])).common_factor(3) == \
        pytest.approx(2.0, rel=1e-3)


def test_no_common_factor_for_differing_factors_a_changed_shape_or_other_mismatches():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    assert _scales([(a * 2, a), (b * 3, b)]).common_factor(2) is None
    changed = a * 2
    changed[0] += 1.0  # one element off: not a scaled copy
    assert _scales([(changed, a), (b * 2, b)]).common_factor(2) is None
    # an output mismatch besides the gradients': the factor does not explain the failure
    assert _scales([(a * 2, a), (b * 2, b)]).common_factor(3) is None
    # the factor 1: nothing is scaled
    assert _scales([(a, a)], failed=[True]).common_factor(1) is None


def test_a_factor_of_one_over_the_world_size_names_an_average():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, generator=g)
    plan = [Step("sync", "blocks.0", {"mode": "bwd_post", "sync_op_or_fn": "all_reduce"}),
            Step("shard", "blocks.0.fc", {"tensor_name": "weight", "axis": 0}),
            Step("sync", "head", {"mode": "fwd_post", "sync_op_or_fn": "all_gather", "axis": -1})]
    assert _scales([(a / 4, a)]).hint(1, 4, plan) == (
        "every gradient is 0.25 times the original's (1 nonzero gradients, one common factor; the outputs agree): "
        "1 / the world size, 4. A gradient was averaged over the ranks where it must be summed (a bwd_post sync "
        "that divides by the world size); sync steps that could do it: #0 sync at 'blocks.0' (mode='bwd_post', "
        "sync_op_or_fn='all_reduce')")
