"""transformers' packed-sequence check is answered without the GPU only for positions the model makes."""

import pytest
import torch

import schedlang
from schedlang.models import optimize_model, packed_sequences

transformers = pytest.importorskip("transformers")


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=56, vocab_size=89, max_position_embeddings=32)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=89, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture
def checks(monkeypatch):
    """How often transformers' own check ran."""
    optimize_model(schedlang.create_schedule(_llama()), compile=None)  # installs the wrapper
    calls = []
    original = packed_sequences._ORIGINAL[0]

    def counting(position_ids, *args, **kwargs):
        calls.append(position_ids.clone())
        return original(position_ids, *args, **kwargs)

    monkeypatch.setattr(packed_sequences, "_ORIGINAL", [counting])
    return calls


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_own_positions_skip_the_check_and_given_ones_do_not(make, checks):
    plain = make()
    sch = schedlang.create_schedule(make())
    optimize_model(sch, compile=None, fused_kernels=False)
    assert any(a.startswith("masks:") for a in sch.metadata["optimize"]["applied"])
    model, _ = schedlang.build(sch)
    ids = torch.randint(0, 89, (2, 12), generator=torch.Generator().manual_seed(1))
    # two sequences of 6 packed in each row
    packed = torch.arange(6).repeat(2).expand(2, -1)
    with torch.no_grad():
        ref = plain(input_ids=ids, use_cache=False).logits
        ref_packed = plain(input_ids=ids, position_ids=packed, use_cache=False).logits
        alone = plain(input_ids=ids[:, 6:], use_cache=False).logits
        assert len(checks) == 3  # the plain model checks every call, its own positions too
        checks.clear()
        out = model(input_ids=ids, use_cache=False).logits
        assert checks == []  # the model's own positions: answered without the check
        torch.testing.assert_close(out, ref)
        out = model(input_ids=ids, position_ids=packed, use_cache=False).logits
        assert len(checks) == 1 and torch.equal(checks[0], packed)  # given positions: checked
    torch.testing.assert_close(out, ref_packed)
    # and the mask kept the packed sequences apart: the second of a row sees only itself
    torch.testing.assert_close(out[:, 6:], alone, rtol=1e-4, atol=1e-5)
    assert not packed_sequences._OWN_POSITIONS.get()


def test_positions_given_positionally_are_checked(checks):
    sch = schedlang.create_schedule(_llama())
    optimize_model(sch, compile=None)
    model, _ = schedlang.build(sch)
    ids = torch.randint(0, 89, (1, 8))
    with torch.no_grad():
        model(ids, None, torch.arange(8)[None], use_cache=False)  # input_ids, attention_mask, position_ids
    assert len(checks) == 1


def test_a_forward_that_raises_leaves_no_mark_and_other_models_are_untouched(checks):
    sch = schedlang.create_schedule(_llama())
    optimize_model(sch, compile=None)
    model, _ = schedlang.build(sch)
    with pytest.raises(Exception):
        model(input_ids=torch.full((1, 4), 10_000), use_cache=False)  # out of the vocabulary
    assert not packed_sequences._OWN_POSITIONS.get()
    with torch.no_grad():
        _llama()(input_ids=torch.randint(0, 89, (1, 8)), use_cache=False)  # not optimized: checked as before
    assert len(checks) == 1


def test_a_model_compiled_whole_has_no_graph_break_and_the_same_loss():
    from torch._dynamo.utils import counters

    plain = _llama()
    sch = schedlang.create_schedule(_llama())
    optimize_model(sch, compile=None, fused_kernels=False)
    model, _ = schedlang.build(sch)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")  # dynamo is what counts; Inductor's CPU build is slow
    ids = torch.randint(0, 89, (2, 12), generator=torch.Generator().manual_seed(2))
    loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(loss, plain(input_ids=ids, labels=ids, use_cache=False).loss)
    assert not packed_sequences._OWN_POSITIONS.get()


def test_models_that_derive_their_positions_keep_the_check():
    model = _llama()
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}  # multimodal
    assert not packed_sequences.skip_packed_sequence_check(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    model = _llama()
    model.config.vision_config = {"hidden_size": 8}
    assert not packed_sequences.skip_packed_sequence_check(model)
    assert packed_sequences.skip_packed_sequence_check(_llama())


def test_marked_pipeline_stages_skip_the_check_and_keep_the_mask_answer(checks):
    """A traced stage runs no hook of its model: the stages get marks of their own. Stand-ins for two stages here:
    the marked one is answered without the check, with the logits the plain model gives; an unmarked one checks."""
    plain, stage, other = _llama(), _llama(), _llama()
    assert packed_sequences.skip_packed_sequence_check_in_stages(plain, [stage])
    ids = torch.randint(0, 89, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = stage(input_ids=ids, use_cache=False).logits
        assert checks == []
        torch.testing.assert_close(out, plain(input_ids=ids, use_cache=False).logits)
        assert len(checks) == 1  # the model the stages were cut from is not marked by it
        other(input_ids=ids, use_cache=False)
        assert len(checks) == 2
    assert not packed_sequences._OWN_POSITIONS.get()


def test_stages_of_a_model_that_derives_its_positions_keep_the_check():
    model, stage = _llama(), _llama()
    model.config.vision_config = {"hidden_size": 8}
    assert not packed_sequences.skip_packed_sequence_check_in_stages(model, [stage])
    assert not stage._forward_pre_hooks and not stage._forward_hooks
