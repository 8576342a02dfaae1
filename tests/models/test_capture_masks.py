"""Under CUDA graph capture an optimized model's calls without a padding mask leave the causal mask to SDPA,
as outside the capture; padding masks and other models go through transformers' check unchanged.

No capture can run on the CPU: the tests stand in for one at the single point that asks
(``capture_masks._capturing_eagerly``), and for transformers' check with one that answers as transformers 5.17
does under capture (no skip), so each case shows which answer reached the layers.
"""

import itertools

import pytest
import torch

import schedlang
from schedlang.models import capture_masks, optimize_model

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")
if not hasattr(masking_utils, "_ignore_causal_mask_sdpa"):
    pytest.skip("this transformers has no causal-mask skip check", allow_module_level=True)

VOCAB = 89


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=56, vocab_size=VOCAB, max_position_embeddings=32)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _optimized():
    sch = schedlang.create_schedule(_llama())
    optimize_model(sch, compile=None)
    assert any(a.startswith("capture:") for a in sch.metadata["optimize"]["applied"]), sch.metadata["optimize"]
    return schedlang.build(sch)[0]


def _transformers_check():
    check = masking_utils._ignore_causal_mask_sdpa
    return getattr(check, "__wrapped__", check)


def test_the_answer_without_padding_is_transformers_own_outside_capture():
    check = _transformers_check()
    for q_length, kv_length, q_offset, window in itertools.product((1, 5, 8), (5, 8, 13), (0, 3), (None, 4, 64)):
        expected = bool(check(None, q_length, kv_length, q_offset, 0, local_attention_size=window))
        assert capture_masks.skip_without_padding(q_length, kv_length, q_offset, window) is expected, \
            (q_length, kv_length, q_offset, window)


@pytest.fixture
def under_capture(monkeypatch):
    """A capture in progress, and transformers' check answering as 5.17 does under capture: never skip.
    Yields the calls that reached transformers' check."""
    _optimized()  # installs the wrapper
    calls = []

    def no_skip_under_capture(padding_mask, *args, **kwargs):
        calls.append(padding_mask)
        return False

    monkeypatch.setattr(capture_masks, "_ORIGINAL", [no_skip_under_capture])
    monkeypatch.setattr(capture_masks, "_capturing_eagerly", lambda: True)
    return calls


def _masks_seen_by_the_layers(model, **kwargs):
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        with torch.no_grad():
            logits = model(**kwargs, use_cache=False).logits
    finally:
        handle.remove()
    return seen, logits


def test_an_optimized_call_without_padding_leaves_the_mask_to_sdpa(under_capture):
    model = _optimized()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    seen, logits = _masks_seen_by_the_layers(model, input_ids=ids)
    assert seen == [None] and under_capture == []  # answered without transformers' check
    # the same logits as the plain model outside the capture (the causal mask applied by SDPA)
    torch.testing.assert_close(logits, _llama()(input_ids=ids, use_cache=False).logits)
    assert not capture_masks._IN_MARKED_MODEL.get()


def test_a_padding_mask_and_other_models_go_through_transformers_check(under_capture):
    model = _optimized()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(ids)
    padding[0, :2] = 0
    seen, _ = _masks_seen_by_the_layers(model, input_ids=ids, attention_mask=padding)
    assert len(under_capture) == 1 and under_capture[0] is not None  # the padding mask was checked
    assert isinstance(seen[0], torch.Tensor)  # and a mask tensor reached the layers
    under_capture.clear()
    seen, _ = _masks_seen_by_the_layers(_llama(), input_ids=ids)  # a model that was not optimized
    assert under_capture == [None] and isinstance(seen[0], torch.Tensor)


def test_a_forward_that_raises_leaves_no_mark(under_capture):
    model = _optimized()
    with pytest.raises(Exception):
        model(input_ids=torch.full((1, 4), 10_000), use_cache=False)  # out of the vocabulary
    assert not capture_masks._IN_MARKED_MODEL.get()


def test_outside_a_capture_transformers_answers(monkeypatch):
    _optimized()
    calls = []
    original = capture_masks._ORIGINAL[0]

    def counting(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("padding_mask"))
        return original(*args, **kwargs)

    monkeypatch.setattr(capture_masks, "_ORIGINAL", [counting])
    with torch.no_grad():
        _optimized()(input_ids=torch.randint(0, VOCAB, (1, 6)), use_cache=False)
    assert calls == [None]
