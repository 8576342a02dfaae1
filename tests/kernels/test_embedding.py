"""embedding (the weight's gradient from Triton, interpreted on CPU) against its reference and nn.Embedding,
outputs and weight gradients; FusedEmbedding built from the nn.Embedding it replaces."""

import pytest
import torch
from torch import nn

from schedlang.errors import SchedlangError, ScheduleTypeError, ScheduleValueError
from schedlang.kernels import embedding
from schedlang.kernels.embedding import embedding_backward, reference
from schedlang.kernels.modules import FusedEmbedding, fused_embedding_like
from tests.kernels.numerics import assert_close_scaled

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(ids, weight, padding_idx=None, grad=None, fn=embedding):
    """``fn``'s output and the weight's gradient for the cotangent ``grad`` (fresh random when None)."""
    w = weight.detach().clone().requires_grad_(True)
    out = fn(ids, w, padding_idx)
    out.backward(grad if grad is not None else torch.randn(out.shape).to(out.dtype))
    return out, w.grad


def _compare(ids, weight, padding_idx=None, grad=None):
    """Kernel against reference on the same inputs and cotangent: the outputs bit for bit (a lookup), the
    gradients within the dtype's tolerance and of the weight's dtype. Returns the kernel's gradient."""
    if grad is None:
        grad = torch.randn(ids.shape + (weight.shape[1],)).to(weight.dtype)
    out, got = _run(ids, weight, padding_idx, grad)
    ref, want = _run(ids, weight, padding_idx, grad, fn=reference)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert got.dtype == want.dtype == weight.dtype
    assert_close_scaled(got, want, weight.dtype, "grad weight")
    return got


def _exact_grad(ids, grad, num_embeddings, padding_idx=None):
    """The weight's gradient summed in fp64: what the kernel's one rounding approaches."""
    exact = torch.zeros(num_embeddings, grad.shape[-1], dtype=torch.float64, device=grad.device)
    exact.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).double())
    if padding_idx is not None:
        exact[padding_idx] = 0
    return exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab, dim, ids_shape, padding_idx", [
    (37, 100, (3, 11), None), (5, 3, (17,), None), (37, 100, (3, 11), 4), (5, 3, (17,), -2), (6, 2100, (2, 9), None),
], ids=["37x100", "5x3", "37x100-pad", "5x3-negative-pad", "6x2100-tiles"])
def test_matches_reference(vocab, dim, ids_shape, padding_idx, dtype):
    weight = torch.randn(vocab, dim).to(dtype)
    ids = torch.randint(0, vocab, ids_shape)
    ids.view(-1)[:3] = 1  # a repeated id at least
    grad = torch.randn(ids_shape + (dim,)).to(dtype)
    got = _compare(ids, weight, padding_idx, grad)
    pad = None if padding_idx is None else padding_idx % vocab
    assert_close_scaled(got, _exact_grad(ids, grad, vocab, pad), dtype, "grad against the fp64 sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_id_in_most_positions_and_ids_never_used(dtype):
    """70 of 85 positions hold id 7 (several steps of the segment loop), a few others hold 2 or 30; the
    34 rows never looked up get exact zeros."""
    ids = torch.full((5, 17), 7)
    ids.view(-1)[torch.randperm(85)[:15]] = torch.tensor([2, 30]).repeat(8)[:15]
    weight = torch.randn(37, 100).to(dtype)
    got = _compare(ids, weight)
    unused = [v for v in range(37) if v not in (2, 7, 30)]
    assert torch.equal(got[unused], torch.zeros(len(unused), 100, dtype=dtype))
    assert got[7].abs().max() > 0


@pytest.mark.parametrize("counts, padding_idx", [
    ({0: 20, 1: 600, 3: 80}, None),   # id 1 starts inside chunk 0 and spans 19 more; chunk 19 meets ids 1 and 3
    ({0: 128, 2: 64, 4: 65}, None),   # ids 0 and 2 fill chunks 0-3 and 4-5 exactly; id 4 ends one into chunk 8
    ({0: 20, 1: 600, 3: 80}, 1),      # a long padding row is skipped by both passes
], ids=["spans", "chunk-aligned", "long-padding"])
def test_long_segments_are_summed_from_chunk_partials(counts, padding_idx):
    """Ids in more positions than a chunk of the sorted ids (32) take the two-pass path: partial sums per
    chunk, then their sum in chunk order; shuffled, so the sort's permutation is not the identity. In bf16
    the reference on CPU adds 600 rows in bf16 (3% off the exact sum), so the kernel's bf16 gradient is
    checked against the reference's fp32 gradient of the same values, and against the fp64 sum."""
    ids = torch.cat([torch.full((c,), v) for v, c in counts.items()] + [torch.randint(5, 11, (30,))])
    ids = ids[torch.randperm(ids.numel())]
    weight, grad = torch.randn(11, 3), torch.randn(ids.shape + (3,))
    got = _compare(ids, weight, padding_idx, grad)
    assert_close_scaled(got, _exact_grad(ids, grad, 11, padding_idx), torch.float32, "grad against the fp64 sum")
    low = _run(ids, weight.bfloat16(), padding_idx, grad.bfloat16())[1]
    assert low.dtype == torch.bfloat16
    want = _run(ids, weight.bfloat16().float(), padding_idx, grad.bfloat16().float(), fn=reference)[1]
    assert_close_scaled(low, want, torch.bfloat16, "bf16 grad against the fp32 reference")
    assert_close_scaled(low, _exact_grad(ids, grad.bfloat16(), 11, padding_idx), torch.bfloat16, "bf16 grad")


@pytest.mark.parametrize("padding_idx", [3, -1])
def test_padding_row_gets_no_gradient(padding_idx):
    weight = torch.randn(37, 100)
    ids = torch.randint(0, 37, (3, 11))
    ids[:, -4:] = padding_idx % 37  # the pad id, frequent, at the end of each row
    got = _compare(ids, weight, padding_idx)
    assert torch.equal(got[padding_idx % 37], torch.zeros(100))
    # the same ids without padding_idx do give that row a gradient
    assert _run(ids, weight)[1][padding_idx % 37].abs().max() > 0


def test_non_contiguous_output_gradient():
    weight, ids = torch.randn(37, 100), torch.randint(0, 37, (17,))
    transposed = torch.randn(100, 17).t()  # (17, 100), columns strided
    assert not transposed.is_contiguous()
    _compare(ids, weight, grad=transposed)
    every_other_row = torch.randn(34, 100)[::2]  # rows strided, columns contiguous
    _compare(ids, weight, grad=every_other_row)
    # the gradient of a sum reaches the lookup expanded (all strides zero)
    ours, theirs = weight.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    embedding(ids.view(1, 17), ours).sum().backward()
    reference(ids.view(1, 17), theirs).sum().backward()
    assert_close_scaled(ours.grad, theirs.grad, torch.float32, "grad of a sum")


def test_lower_precision_output_gradient_on_an_fp32_weight():
    """A bf16 / fp16 output gradient is accumulated in fp32 and written in the weight's dtype."""
    ids = torch.randint(0, 37, (3, 11))
    for dtype in (torch.bfloat16, torch.float16):
        grad = torch.randn(3, 11, 100).to(dtype)
        got = embedding_backward(grad, ids, 37, None, torch.float32)
        assert got.dtype == torch.float32
        want = _run(ids, torch.randn(37, 100), grad=grad.float(), fn=reference)[1]
        assert_close_scaled(got, want, torch.float32, f"{dtype} gradient")


def test_empty_ids_and_int32_ids():
    weight = torch.randn(5, 3)
    out, got = _run(torch.zeros(0, 4, dtype=torch.long), weight)
    assert out.shape == (0, 4, 3) and torch.equal(got, torch.zeros(5, 3))
    _compare(torch.randint(0, 5, (17,), dtype=torch.int32), weight)


def test_two_backward_runs_agree_bit_for_bit():
    ids = torch.randint(0, 6, (3, 11))
    ids[0] = 2
    weight = torch.randn(6, 2100)
    grad = torch.randn(3, 11, 2100)
    first, second = _run(ids, weight, grad=grad)[1], _run(ids, weight, grad=grad)[1]
    assert torch.equal(first, second)


def test_reference_is_nn_embedding():
    module = nn.Embedding(37, 100, padding_idx=5)
    ids = torch.randint(0, 37, (3, 11))
    ids[0, :3] = 5
    grad = torch.randn(3, 11, 100)
    out, got = _run(ids, module.weight, 5, grad, fn=reference)
    want = module(ids)
    want.backward(grad)
    assert torch.equal(out, want) and torch.equal(got, module.weight.grad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the GPU an id out of range is a device-side assert")
def test_ids_out_of_range_fail_in_the_forward():
    with pytest.raises(IndexError):
        embedding(torch.tensor([0, 5]), torch.randn(5, 3, requires_grad=True))


@pytest.mark.parametrize("call, message", [
    (lambda: embedding([0, 1], torch.randn(5, 3)), r"^embedding: ids must be a torch.Tensor, got list$"),
    (lambda: embedding(torch.zeros(4), torch.randn(5, 3)),
     r"^embedding: ids has dtype torch.float32: expected one of int64, int32$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.int16), torch.randn(5, 3)),
     r"^embedding: ids has dtype torch.int16: expected one of int64, int32$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.long), torch.ones(5, 3, dtype=torch.long)),
     r"^embedding: weight has dtype torch.int64: expected one of float32, bfloat16, float16, float64$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.long), torch.randn(5)),
     r"^embedding: weight of shape \(5,\) must be 2-D: expected \(num_embeddings, embedding_dim\)$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.long), torch.randn(5, 3), padding_idx=5),
     r"^embedding: padding_idx=5 is out of range for 5 embeddings: valid are -5..4 or None$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.long), torch.randn(5, 3), padding_idx=-6),
     r"^embedding: padding_idx=-6 is out of range for 5 embeddings: valid are -5..4 or None$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.long), torch.randn(5, 3), padding_idx="0"),
     r"^embedding: padding_idx must be an int or None, got '0'$"),
    (lambda: embedding(torch.zeros(4, dtype=torch.long), torch.randn(5, 3), padding_idx=True),
     r"^embedding: padding_idx must be an int or None, got True$"),
], ids=["ids list", "ids float", "ids int16", "weight long", "weight 1-d", "pad too big", "pad too small",
        "pad str", "pad bool"])
def test_bad_inputs_are_refused_by_name(call, message):
    with pytest.raises(ScheduleValueError, match=message):
        call()


def test_fused_embedding_shares_the_weight_and_matches_nn_embedding():
    original = nn.Embedding(37, 100, padding_idx=-3)
    fused = FusedEmbedding.from_module(original)
    assert fused.weight is original.weight
    assert (fused.num_embeddings, fused.embedding_dim, fused.padding_idx) == (37, 100, 34)
    assert dict(fused.named_parameters()).keys() == dict(original.named_parameters()).keys()
    assert repr(fused) == "FusedEmbedding(37, 100, padding_idx=34)"
    ids = torch.randint(0, 37, (3, 11))
    ids[1, :4] = 34
    grad = torch.randn(3, 11, 100)
    out = fused(ids)
    out.backward(grad)
    ours = original.weight.grad.clone()
    original.weight.grad = None
    want = original(ids)
    want.backward(grad)
    assert torch.equal(out, want)
    assert_close_scaled(ours, original.weight.grad, torch.float32, "grad weight")
    assert torch.equal(ours[34], torch.zeros(100))


def test_fused_embedding_replaces_a_llama_embedding_in_a_schedule():
    import schedlang
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=100, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    sch = schedlang.create_schedule(model)
    scheduled = sch["model.embed_tokens"].mod  # the schedule's own copy of the user's model
    assert sch.replace_all(nn.Embedding, fused_embedding_like) == ["model.embed_tokens"]
    fused = sch.mod.model.embed_tokens
    assert isinstance(fused, FusedEmbedding) and fused.weight is scheduled.weight
    assert torch.equal(fused.weight, model.model.embed_tokens.weight)
    ids = torch.randint(0, 96, (2, 9))
    out = sch.mod(ids).logits
    out.pow(2).sum().backward()
    ours = fused.weight.grad.clone()
    model.zero_grad()
    ref = model(ids).logits
    ref.pow(2).sum().backward()
    assert_close_scaled(out, ref, torch.float32, "logits")
    assert_close_scaled(ours, model.model.embed_tokens.weight.grad, torch.float32, "grad embed_tokens")


class _ScaledEmbedding(nn.Embedding):
    def forward(self, input):
        return super().forward(input) * 8.0


@pytest.mark.parametrize("module, error, message", [
    (nn.Embedding(10, 4, max_norm=1.0), ScheduleValueError,
     r"^FusedEmbedding.from_module: Embedding has max_norm=1.0, which FusedEmbedding does not implement: only "
     r"max_norm=None is supported$"),
    (nn.Embedding(10, 4, scale_grad_by_freq=True), ScheduleValueError,
     r"^FusedEmbedding.from_module: Embedding has scale_grad_by_freq=True, which FusedEmbedding does not "
     r"implement: only scale_grad_by_freq=False is supported$"),
    (nn.Embedding(10, 4, sparse=True), ScheduleValueError,
     r"^FusedEmbedding.from_module: Embedding has sparse=True, which FusedEmbedding does not implement: only "
     r"sparse=False is supported$"),
    (nn.Linear(4, 4), ScheduleTypeError,
     r"^FusedEmbedding.from_module: Linear is not an nn.Embedding: expected an nn.Embedding"),
    (_ScaledEmbedding(10, 4), ScheduleValueError,
     r"^FusedEmbedding.from_module: _ScaledEmbedding overrides nn.Embedding.forward: only a plain "
     r"nn.Embedding's lookup is replaced$"),
], ids=["max_norm", "scale_grad_by_freq", "sparse", "linear", "subclass"])
def test_from_module_refuses_what_it_does_not_implement(module, error, message):
    with pytest.raises(error, match=message):
        FusedEmbedding.from_module(module)


def test_fused_embedding_constructor():
    fused = FusedEmbedding(10, 4, padding_idx=-1)
    assert fused.padding_idx == 9 and torch.equal(fused.weight[9], torch.zeros(4))
    assert fused.weight.shape == (10, 4) and fused.weight.abs().sum() > 0
    with pytest.raises(SchedlangError, match=r"^FusedEmbedding: num_embeddings must be an int >= 1, got 0$"):
        FusedEmbedding(0, 4)
    with pytest.raises(SchedlangError, match=r"^FusedEmbedding: padding_idx=10 is out of range for 10 embeddings: "
                                             r"valid are -10..9 or None$"):
        FusedEmbedding(10, 4, padding_idx=10)


@pytest.mark.gpu
def test_llama_sizes_on_gpu():
    """LLaMA-1.1B's embedding (8192 tokens, vocabulary 32000, hidden 2048, fp32 weight): fp32 and bf16
    output gradients against the fp64 sum; a skewed batch (half the tokens one id); two runs bit for bit;
    the backward captured in a CUDA graph (no host sync) replays to the same bits."""
    vocab, dim = 32000, 2048
    weight = torch.randn(vocab, dim, device="cuda")
    uniform = torch.randint(0, vocab, (4, 2048), device="cuda")
    skewed = uniform.clone()
    skewed.view(-1)[torch.randperm(8192, device="cuda")[:4096]] = 2
    for ids in (uniform, skewed):
        grad = torch.randn(4, 2048, dim, device="cuda")
        got = _compare(ids, weight, grad=grad)
        assert torch.equal(got, _run(ids, weight, grad=grad)[1])
        assert_close_scaled(got, _exact_grad(ids, grad, vocab), torch.float32, "fp32 grad against the fp64 sum")
        low = grad.bfloat16()
        got = embedding_backward(low, ids, vocab, None, torch.float32)
        assert_close_scaled(got, _exact_grad(ids, low, vocab), torch.float32, "bf16 grad against the fp64 sum")
    grad = torch.randn(4, 2048, dim, device="cuda")
    eager = embedding_backward(grad, uniform, vocab, 0, torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        embedding_backward(grad, uniform, vocab, 0, torch.float32)  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = embedding_backward(grad, uniform, vocab, 0, torch.float32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
