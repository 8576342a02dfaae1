"""grouped_mm (Triton, interpreted on CPU) against its reference and a per-expert matmul loop in fp64: outputs
and the gradients of x and w, on irregular shapes with experts of no rows; its tile schedule; the experts
forward built on it against the families' own expert loops; torch._grouped_mm against both on a GPU."""

import copy

import pytest
import torch
import triton

from schedlang.errors import SchedlangError
from schedlang.kernels.grouped_gemm import grouped_mm, reference, tile_schedule, torch_grouped_mm_supports
from schedlang.kernels.grouped_gemm_experts import grouped_experts_forward, standard_layout_mismatch
from tests.kernels.numerics import assert_close_scaled

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _loop_fp64(x, w, counts, transposed):
    """The product as one fp64 matmul per expert, written out independently of the code under test."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        we = w[e].double().t() if transposed else w[e].double()
        out.append(x[start:start + c].double() @ we)
        start += c
    return torch.cat(out)


def _run(fn, x, w, counts, transposed, grad):
    xx, ww = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = fn(xx, ww, counts, transposed)
    out.backward(grad)
    return out, xx.grad, ww.grad


def _randn(*shape, generator, dtype):
    """Seeded values made on the CPU, moved to the default device (CUDA when the tests run on a GPU)."""
    return torch.randn(*shape, generator=generator, device="cpu").to(torch.empty(0).device, dtype)


def _inputs(counts, k, n, dtype, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    m, e = int(counts.sum()), counts.shape[0]
    x = _randn(m, k, generator=g, dtype=dtype)
    w = _randn(*((e, n, k) if transposed else (e, k, n)), generator=g, dtype=dtype)
    grad = _randn(m, n, generator=g, dtype=dtype)
    return x, w, counts, grad


def _compare(counts, k, n, dtype, transposed, seed=0):
    x, w, counts, grad = _inputs(counts, k, n, dtype, transposed, seed)
    triton_fn = lambda *a: grouped_mm(*a, backend="triton")  # noqa: E731
    got = _run(triton_fn, x, w, counts, transposed, grad)
    ref = _run(reference, x, w, counts, transposed, grad)
    # the exact values: fp64 per-expert matmuls of the same (rounded) inputs, and their gradients
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    _loop_fp64(x64, w64, counts, transposed).backward(grad.double())
    exact = (_loop_fp64(x, w, counts, transposed), x64.grad, w64.grad)
    for what, a, b, c in zip(("out", "grad x", "grad w"), got, ref, exact):
        assert a.dtype == dtype and a.shape == b.shape
        assert_close_scaled(a, b, dtype, f"{what} against the reference")
        assert_close_scaled(a, c, dtype, f"{what} against the fp64 loop")
    return got, counts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk"])
@pytest.mark.parametrize("counts, k, n", [
    ([5, 0, 19, 1, 0], 23, 37),        # experts of no rows inside and at the end, K and N not tile multiples
    ([0, 40, 3], 50, 17),              # an empty first expert; 40 rows: three tiles of 16 rows, the last partial
    ([16, 16], 32, 32),                # tile-aligned everywhere
    ([1], 3, 70),                      # one expert, one row, N over two column tiles
], ids=["gaps", "empty-first", "aligned", "single"])
def test_matches_reference_and_loop(counts, k, n, dtype, transposed):
    (out, grad_x, grad_w), counts_t = _compare(counts, k, n, dtype, transposed)
    for e, c in enumerate(counts):
        if c == 0:  # an expert of no rows gets an exact zero gradient
            assert torch.equal(grad_w[e], torch.zeros_like(grad_w[e]))
        else:
            assert grad_w[e].abs().max() > 0


def test_no_rows_at_all():
    for backend in ("triton", "reference"):
        x = torch.randn(0, 6, requires_grad=True)
        w = torch.randn(3, 6, 5, requires_grad=True)
        out = grouped_mm(x, w, torch.zeros(3, dtype=torch.long), backend=backend)
        assert out.shape == (0, 5)
        out.sum().backward()
        assert torch.equal(w.grad, torch.zeros(3, 6, 5)) and x.grad.shape == (0, 6)


def test_strided_inputs_and_gradient():
    """x a transposed view, w a slice along its experts, the output gradient with strided rows."""
    counts = torch.tensor([7, 0, 12])
    x = torch.randn(23, 19).t()                 # (19, 23), columns strided
    w = torch.randn(5, 23, 9)[1:4]              # not starting at the storage's start
    grad = torch.randn(38, 9)[::2]               # (19, 9), rows strided
    got = _run(lambda *a: grouped_mm(*a, backend="triton"), x, w, counts, False, grad)
    want = _run(reference, x, w, counts, False, grad)
    for what, a, b in zip(("out", "grad x", "grad w"), got, want):
        assert_close_scaled(a, b, torch.float32, what)


def test_only_one_input_needs_a_gradient():
    x, w, counts, grad = _inputs([4, 0, 9], 11, 13, torch.float32, True)
    w.requires_grad_(True)
    grouped_mm(x, w, counts, transposed=True, backend="triton").backward(grad)
    ref = w.detach().clone().requires_grad_(True)
    reference(x, ref, counts, True).backward(grad)
    assert_close_scaled(w.grad, ref.grad, torch.float32, "grad w")


@pytest.mark.parametrize("counts, block_m", [([5, 0, 19, 1, 0], 16), ([0, 0], 4), ([33], 16), ([16, 16, 0], 16)])
def test_tile_schedule(counts, block_m):
    """Every row tile once, in order, with its expert and first row; the slots past the last tile marked -1."""
    t = torch.tensor(counts)
    tile_expert, tile_row, row_start, row_end = tile_schedule(t, sum(counts), block_m)
    want, start = [], 0
    for e, c in enumerate(counts):
        want += [(e, start + r) for r in range(0, c, block_m)]
        start += c
    slots = triton.cdiv(sum(counts), block_m) + len(counts)
    assert tile_expert.shape[0] == tile_row.shape[0] == slots >= len(want)
    got = [(int(e), int(r)) for e, r in zip(tile_expert.tolist(), tile_row.tolist()) if e >= 0]
    assert got == want
    assert tile_expert.tolist()[len(want):] == [-1] * (slots - len(want))
    assert row_end.tolist() == torch.tensor(counts).cumsum(0).tolist()
    assert (row_end - row_start).tolist() == counts


def test_reference_runs_on_cpu_without_the_interpreter(monkeypatch):
    """backend='auto' on CPU takes the reference unless the interpreter runs the kernels; float64 always does."""
    x, w, counts, _ = _inputs([2, 3], 4, 5, torch.float64, False)
    calls = []
    import schedlang.kernels.grouped_gemm as module

    monkeypatch.setattr(module, "reference", lambda *a: calls.append(a) or reference(*a))
    grouped_mm(x, w, counts)
    assert len(calls) == 1


@pytest.mark.parametrize("call, words", [
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 5, 6), torch.tensor([2, 2])), "x has 3 columns"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([2, 1])), "add up to the 4 rows"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([5, -1])), "must be >= 0"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([2., 2.])), "must be integers"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([4])), "[E] = [2]"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6).half(), torch.tensor([2, 2])), "one dtype"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(3, 6), torch.tensor([2, 2])), "3-D"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([2, 2]), backend="cublas"),
     "backend='cublas' is not one of"),
    (lambda: grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 6), torch.tensor([2, 2]), transposed=1),
     "transposed must be a bool"),
])
def test_bad_arguments_raise_naming_the_value(call, words):
    # on the CPU, where the counts are checked against the rows (on a GPU that would wait for the device)
    with torch.device("cpu"), pytest.raises(SchedlangError, match="^grouped_mm: ") as info:
        call()
    assert words in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._grouped_mm runs on CUDA only (its CPU "
                    "backward failed in torch 2.13); on CPU the reference is what runs")
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk"])
def test_torch_grouped_mm_matches_triton_on_gpu(transposed):
    x, w, counts, grad = _inputs([40, 0, 200, 8, 0, 1], 64, 96, torch.bfloat16, transposed)
    x, w, counts, grad = x.cuda(), w.cuda(), counts.cuda(), grad.cuda()
    if not torch_grouped_mm_supports(x, w):
        pytest.skip(f"torch._grouped_mm does not take bf16 on {torch.cuda.get_device_name()} with this torch")
    got = _run(lambda *a: grouped_mm(*a, backend="torch"), x, w, counts, transposed, grad)
    ours = _run(lambda *a: grouped_mm(*a, backend="triton"), x, w, counts, transposed, grad)
    ref = _run(reference, x.float(), w.float(), counts, transposed, grad.float())
    for what, a, b, c in zip(("out", "grad x", "grad w"), got, ours, ref):
        assert_close_scaled(a, c, torch.bfloat16, f"torch {what} against the fp32 reference")
        assert_close_scaled(b, c, torch.bfloat16, f"triton {what} against the fp32 reference")


# --- the experts forward on the grouped product -------------------------------------------------------------

def _experts_of(family):
    from tests.helpers.moe_models import tiny_model

    model = tiny_model(family)
    return next(m for m in model.modules() if type(m).__name__.endswith("Experts"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_experts_forward_matches_the_family_loop(family, dtype):
    """Rows sorted by expert, expert 1 receiving none: outputs and the gradients of the rows and both weight
    tensors against the family's own forward (every routing weight 1), the kernels on (interpreted on CPU)."""
    pytest.importorskip("transformers")
    experts = _experts_of(family).to(dtype)
    assert standard_layout_mismatch(experts) is None
    e, h = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]
    counts = torch.tensor([3, 0] + [1 + i % 3 for i in range(e - 2)])
    ids = torch.arange(e).repeat_interleave(counts)
    g = torch.Generator().manual_seed(1)
    rows = _randn(len(ids), h, generator=g, dtype=dtype)
    grad = _randn(len(ids), h, generator=g, dtype=dtype)

    def run(fn):
        mod = copy.deepcopy(experts)
        x = rows.clone().requires_grad_(True)
        out = fn(mod, x)
        out.backward(grad)
        return out, x.grad, mod.gate_up_proj.grad, mod.down_proj.grad

    want = run(lambda mod, x: mod(x, ids[:, None], torch.ones(len(ids), 1, dtype=dtype)))
    for backend in ("triton", "reference"):
        got = run(lambda mod, x: grouped_experts_forward(mod, x, counts, backend=backend))
        for what, a, b in zip(("out", "grad rows", "grad gate_up_proj", "grad down_proj"), got, want):
            assert a.dtype == dtype
            assert_close_scaled(a, b, dtype, f"{backend} {what}")
        assert torch.equal(got[2][1], torch.zeros_like(got[2][1]))  # expert 1: no rows, zero gradient
    if dtype == torch.float32 and not torch.cuda.is_available():
        # on CPU the reference is the family's arithmetic, F.linear per expert: the same bits
        got = run(lambda mod, x: grouped_experts_forward(mod, x, counts, backend="reference"))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_layouts_other_than_the_standard_keep_the_family_forward():
    pytest.importorskip("transformers")
    import transformers as T

    config = T.GptOssConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=16, num_local_experts=4, head_dim=8)
    gpt_oss = next(m for m in T.AutoModelForCausalLM.from_config(config).modules()
                   if type(m).__name__ == "GptOssExperts")
    assert "has_bias" in standard_layout_mismatch(gpt_oss)
    plain = torch.nn.Module()
    plain.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))
    plain.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))
    assert "not a transformers experts module" in standard_layout_mismatch(plain)
    qwen = _experts_of("qwen3_moe")
    qwen.extra_bias = torch.nn.Parameter(torch.zeros(3))
    assert "extra_bias" in standard_layout_mismatch(qwen)
