"""fused_linear_cross_entropy (Triton statistics and gradients, interpreted on CPU) against
F.cross_entropy of the full logits; the vocabulary-parallel variant on two gloo ranks."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from schedlang.errors import SchedlangError, ScheduleValueError
from schedlang.kernels import fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy
from schedlang.kernels.fused_linear_cross_entropy import default_chunk_size, reference
from schedlang.kernels.vocab_parallel_fused_linear_cross_entropy import reference as vp_reference
from tests.helpers.distributed import run_distributed
from tests.kernels.numerics import assert_close_scaled


def _problem(tokens, hidden, vocab, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    # drawn on the host whatever the default device (the GPU tests run with CUDA as default)
    h = torch.randn(tokens, hidden, generator=g, device="cpu").to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, device="cpu") / hidden ** 0.5 * 3).to(dtype)
    b = (torch.randn(vocab, generator=g, device="cpu") * 0.5).to(dtype) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g, device="cpu")
    t[::4] = -100
    return h, w, b, t


def _leaves(*tensors):
    return [x.detach().clone().requires_grad_(True) if x is not None else None for x in tensors]


def _loss_and_grads(fn, h, w, b, t, reduction, **kw):
    h, w, b = _leaves(h, w, b)
    loss = fn(h, w, t, reduction=reduction, bias=b, **kw)
    cot = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1), device="cpu").to(loss.device)
    (loss * cot).sum().backward()
    return loss, [x.grad if x is not None else None for x in (h, w, b)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden,vocab,chunk,reduction,bias", [
    (13, 64, 100, 5, "mean", False),      # several chunks, the last one short
    (7, 96, 257, None, "sum", True),      # one chunk, odd vocabulary, bias
    (100, 64, 1000, 32, "none", True),    # per-token loss: gradients recomputed in backward
    (9, 32, 2500, 4, "mean", False),      # rows wider than one block: each row streamed in blocks, twice
    (10, 32, 2100, 4, "none", True),      # whole blocks unmasked and a masked tail, gradients in backward
])
def test_matches_reference(tokens, hidden, vocab, chunk, reduction, bias, dtype):
    h, w, b, t = _problem(tokens, hidden, vocab, dtype, bias)
    loss, grads = _loss_and_grads(fused_linear_cross_entropy, h, w, b, t, reduction, chunk_size=chunk)
    ref, ref_grads = _loss_and_grads(reference, h, w, b, t, reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close_scaled(loss, ref, dtype, "loss")
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        if r is not None:
            assert g.dtype == dtype
            assert_close_scaled(g, r, dtype, f"grad {name}")


def test_leading_dimensions_ignore_index_and_only_some_gradients():
    h, w, _, t = _problem(2 * 9, 32, 50, torch.float32)
    t[t == -100] = 3
    h3, t3 = h.view(2, 9, 32).requires_grad_(True), t.view(2, 9)
    loss = fused_linear_cross_entropy(h3, w, t3, ignore_index=3, chunk_size=4)  # weight needs no gradient
    loss.backward()
    h_ref = h.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(h_ref @ w.t(), t, ignore_index=3)
    ref.backward()
    assert_close_scaled(loss, ref, torch.float32, "loss")
    assert h3.grad.shape == (2, 9, 32)
    assert_close_scaled(h3.grad.view(18, 32), h_ref.grad, torch.float32, "grad hidden")
    with torch.no_grad():  # no gradient wanted: statistics only
        assert_close_scaled(fused_linear_cross_entropy(h, w, t, ignore_index=3), ref, torch.float32, "no_grad loss")


def test_all_tokens_ignored_gives_nan_like_cross_entropy():
    h, w, _, t = _problem(5, 16, 20, torch.float32)
    t[:] = -100
    assert torch.isnan(fused_linear_cross_entropy(h, w, t)) and torch.isnan(reference(h, w, t))


def test_launch_shape_streams_rows_in_blocks_of_2048_with_more_warps_for_unaligned_rows(monkeypatch):
    flce = importlib.import_module("schedlang.kernels.fused_linear_cross_entropy")  # the module, not the function
    monkeypatch.setattr(flce, "interpreting", lambda: False)  # the GPU's launch shapes
    for vocab in (32000, 128256):
        assert flce._launch_shape(vocab) == {"BLOCK_M": 1, "BLOCK_V": 2048, "num_warps": 4}
    assert flce._launch_shape(50257, aligned_rows=False) == {"BLOCK_M": 1, "BLOCK_V": 2048, "num_warps": 8}
    assert flce._launch_shape(100, aligned_rows=False) == {"BLOCK_M": 1, "BLOCK_V": 128, "num_warps": 4}
    monkeypatch.setattr(flce, "interpreting", lambda: True)  # many rows per program, blocks of at most 1024
    assert flce._launch_shape(2500) == {"BLOCK_M": 4, "BLOCK_V": 1024}


@pytest.mark.parametrize("bias", [False, True])
def test_a_chunks_logits_rows_are_padded_to_the_row_alignment(bias):
    flce = importlib.import_module("schedlang.kernels.fused_linear_cross_entropy")
    h, w, b, _ = _problem(6, 32, 50, torch.float32, bias)
    b = b if bias else None
    logits = flce._logits(h, w, b)
    assert logits.shape == (6, 50) and logits.stride() == (64, 1)  # 50 columns in rows of 64
    torch.testing.assert_close(logits, F.linear(h, w, b))
    padding = logits.as_strided((6, 14), (64, 1), logits.storage_offset() + 50)
    assert torch.equal(padding, torch.zeros_like(padding))  # zeroed: the CPU's bf16 GEMM reads it
    # a vocabulary that is a multiple of the alignment is not padded
    assert flce._logits(h, w[:48], None).stride() == (48, 1)
    assert [flce.padded_width(v) for v in (1, 16, 50257, 32000)] == [16, 16, 50272, 32000]
    # under autocast to another dtype the matmul keeps autocast's cast, unpadded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = flce._logits(h, w, b)
    assert cast.dtype == torch.bfloat16 and cast.is_contiguous()


def test_default_chunk_size():
    assert default_chunk_size(100, 50, torch.float32) == 100  # all tokens in one chunk
    # LLaMA-1.1B head: 8192 tokens x 32000 bf16 logits (0.5 GB) -> two chunks of 4096
    assert default_chunk_size(8192, 32000, torch.bfloat16) == 4096
    assert default_chunk_size(8192, 32000, torch.float32) == 2048


def test_argument_errors():
    h, w, _, t = _problem(6, 16, 20, torch.float32)
    with pytest.raises(SchedlangError, match=r"fused_linear_cross_entropy: invalid reduction 'avg': valid are mean, "
                                             r"sum, none"):
        fused_linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match=r"weight of shape \(20, 8\) does not fit hidden of shape \(6, 16\): "
                                         r"expected \(vocab, 16\)"):
        fused_linear_cross_entropy(h, w[:, :8], t)
    with pytest.raises(ValueError, match=r"target of shape \(5,\) does not fit hidden of shape \(6, 16\): "
                                         r"expected \(6,\)"):
        fused_linear_cross_entropy(h, w, t[:5])
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int \(tokens per chunk\) or None, got 0"):
        fused_linear_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match=r"bias of shape \(19,\) does not fit weight of shape \(20, 16\)"):
        fused_linear_cross_entropy(h, w, t, bias=torch.zeros(19))


@pytest.mark.parametrize("bad_id", [20, 107, -43, -1])
@pytest.mark.parametrize("fn", [fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy],
                         ids=["plain", "vocab_parallel"])
def test_target_ids_outside_the_vocabulary_are_refused(fn, bad_id):
    """The kernel would read such an id's logit as 0 and return a wrong loss without a word."""
    h, w, _, t = _problem(6, 16, 20, torch.float32)
    t[1] = bad_id
    with pytest.raises(ScheduleValueError, match=rf"{fn.__name__}: target holds the id {bad_id}, outside the "
                                                 rf"vocabulary: valid ids are 0..19, or ignore_index=-100"):
        fn(h, w, t)


def test_a_target_equal_to_a_custom_ignore_index_is_not_an_out_of_range_id():
    h, w, _, t = _problem(6, 16, 20, torch.float32)
    t[::4] = -7
    ours = fused_linear_cross_entropy(h, w, t, ignore_index=-7)
    assert_close_scaled(ours, F.cross_entropy(h @ w.t(), t, ignore_index=-7), torch.float32, "loss")
    with pytest.raises(ScheduleValueError, match=r"target holds the id -7, outside the vocabulary"):
        fused_linear_cross_entropy(h, w, t)  # -7 is not the default ignore_index


def test_an_int32_target_gives_the_loss_of_an_int64_one():
    """The Triton kernels read any integer ids; the reference (what CPU users run) takes them too."""
    h, w, _, t = _problem(6, 16, 20, torch.float32)
    expected = fused_linear_cross_entropy(h, w, t)
    assert_close_scaled(fused_linear_cross_entropy(h, w, t.int()), expected, torch.float32, "kernel loss")
    assert_close_scaled(reference(h, w, t.int()), expected, torch.float32, "reference loss")


def test_target_and_dtype_errors():
    h, w, b, t = _problem(6, 16, 20, torch.float32, bias=True)
    with pytest.raises(ScheduleValueError, match=r"fused_linear_cross_entropy: target has dtype torch.float32: "
                                                 r"expected an integer dtype"):
        fused_linear_cross_entropy(h, w, t.clamp(min=0).float())
    with pytest.raises(ScheduleValueError, match=r"fused_linear_cross_entropy: hidden torch.float64, weight "
                                                 r"torch.float32 must have the same dtype"):
        fused_linear_cross_entropy(h.double(), w, t)
    with pytest.raises(ScheduleValueError, match=r"hidden torch.float32, weight torch.float32, bias torch.bfloat16 "
                                                 r"must have the same dtype"):
        fused_linear_cross_entropy(h, w, t, bias=b.bfloat16())
    with pytest.raises(ScheduleValueError, match=r"fused_linear_cross_entropy: hidden must be a torch.Tensor, got list"):
        fused_linear_cross_entropy(h.tolist(), w, t)
    with pytest.raises(ScheduleValueError, match=r"fused_linear_cross_entropy: ignore_index must be an int, got 'x'"):
        fused_linear_cross_entropy(h, w, t, ignore_index="x")


VOCAB_PARALLEL_CASES = [("float32", "mean", False), ("bfloat16", "none", False), ("float32", "sum", True)]


def _vocab_parallel_rank(rank, world):
    """Every case on this rank (one spawn of the ranks for all: starting them is the slow part)."""
    import torch.distributed as dist

    losses = []
    for dtype_name, reduction, use_reference in VOCAB_PARALLEL_CASES:
        dtype = getattr(torch, dtype_name)
        h, w, b, t = _problem(13, 32, 2 * 37, dtype, bias=True, seed=3)
        fn = vp_reference if use_reference else vocab_parallel_fused_linear_cross_entropy
        hl, wl, bl = _leaves(h, w.chunk(world)[rank], b.chunk(world)[rank])
        loss = fn(hl, wl, t, dist.group.WORLD, reduction=reduction, chunk_size=5, bias_shard=bl)
        cot = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1), device="cpu")
        (loss * cot).sum().backward()
        # the whole vocabulary on every rank, in fp32
        hr, wr, br = _leaves(h.float(), w.float(), b.float())
        ref = F.cross_entropy(F.linear(hr, wr, br), t, reduction=reduction)
        (ref * cot).sum().backward()
        case = f"{dtype_name} {reduction} {'reference' if use_reference else 'kernel'} rank {rank}"
        assert_close_scaled(loss, ref, dtype, f"{case}: loss")
        assert_close_scaled(hl.grad, hr.grad, dtype, f"{case}: grad hidden")
        assert_close_scaled(wl.grad, wr.grad.chunk(world)[rank], dtype, f"{case}: grad weight shard")
        assert_close_scaled(bl.grad, br.grad.chunk(world)[rank], dtype, f"{case}: grad bias shard")
        losses.append(loss.detach().sum().item())
    # ids name the whole vocabulary: past this rank's slice is fine, past the last slice is not
    h, w, _, t = _problem(13, 32, 2 * 37, torch.float32, seed=3)
    t[0] = 2 * 37
    with pytest.raises(ScheduleValueError, match=r"target holds the id 74, outside the vocabulary: valid ids are "
                                                 r"0\.\.73"):
        vocab_parallel_fused_linear_cross_entropy(h, w.chunk(world)[rank], t, dist.group.WORLD)
    return losses


def test_vocab_parallel_two_ranks_equals_full_cross_entropy():
    """Kernel (fp32 mean, bf16 per-token) and reference (fp32 sum) with the vocabulary split over two
    gloo ranks, each against F.cross_entropy of the full logits: loss, full gradient of the hidden
    states, and each rank's rows of the weight and bias gradients."""
    losses = run_distributed(_vocab_parallel_rank, world_size=2, backend="gloo", timeout=180)
    assert losses[0] == pytest.approx(losses[1])


def test_vocab_parallel_without_a_group_is_the_plain_kernel():
    h, w, b, t = _problem(9, 16, 30, torch.float32, bias=True)

    def no_group(hidden, weight, target, bias=None, **kw):
        return vocab_parallel_fused_linear_cross_entropy(hidden, weight, target, None, bias_shard=bias, **kw)

    ours, grads = _loss_and_grads(no_group, h, w, b, t, "mean", chunk_size=4)
    ref, ref_grads = _loss_and_grads(reference, h, w, b, t, "mean")
    assert_close_scaled(ours, ref, torch.float32, "loss")
    for g, r in zip(grads, ref_grads):
        assert_close_scaled(g, r, torch.float32, "grad")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,vocab", [(2048, 32000), (1024, 50257)])  # LLaMA-2's head; GPT-2's, rows unaligned
def test_llama_and_gpt2_heads_on_gpu(hidden, vocab):
    h, w, _, t = _problem(4096, hidden, vocab, torch.bfloat16)
    h, w, t = h.cuda(), w.cuda(), t.cuda()
    loss, grads = _loss_and_grads(fused_linear_cross_entropy, h, w, None, t, "mean")
    ref, ref_grads = _loss_and_grads(reference, h, w, None, t, "mean")
    assert_close_scaled(loss, ref, torch.bfloat16, "loss")
    for g, r in zip(grads[:2], ref_grads[:2]):
        assert_close_scaled(g, r, torch.bfloat16, "grad")
