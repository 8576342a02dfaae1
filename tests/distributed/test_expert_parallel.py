"""Expert parallelism on gloo: the token all-to-all against a dense reference, and four transformers
families whose ranks each run their own batch against one process running every batch."""

from __future__ import annotations

import copy

import pytest
import torch

from schedlang.distributed.expert_parallel import expert_parameters, reduce_gradients, route_to_experts
from tests.helpers.distributed import run_distributed
from tests.helpers.moe_models import FAMILIES, rank_batches, tiny_model

pytest.importorskip("transformers")

TOL = dict(rtol=1e-4, atol=1e-5)
TOLS = {torch.float32: TOL, torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _close(actual, expected, dtype):
    """float32: tight; bfloat16: each rounding of a product or sum is off by up to 2^-8 of the values it
    combines, so the absolute error is bounded relative to the tensor's largest magnitude."""
    tol = dict(TOLS[dtype])
    if dtype == torch.bfloat16:
        tol["atol"] = tol["atol"] * max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(actual.float(), expected, **tol)


def _dense_route(hidden, index, weights, expert_weights):
    """Every token's weighted sum of its experts' outputs, one token at a time (ids out of range skipped)."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if 0 <= e < expert_weights.shape[0]:
                out[t] += weights[t, j] * torch.tanh(hidden[t] @ expert_weights[e])
    return out


def _route_case(rank: int, world: int, experts: int = 8):
    """Rank ``rank``'s tokens and choices; experts 1 and 6 chosen by no token anywhere, and one choice
    the padding id ``experts``."""
    g = torch.Generator().manual_seed(10 + rank)
    tokens = 3 + 4 * rank
    allowed = torch.tensor([0, 2, 3, 4, 5, 7])
    index = allowed[torch.randint(0, len(allowed), (tokens, 2), generator=g)]
    index[0, 1] = experts
    hidden = torch.randn(tokens, 12, generator=g)
    weights = torch.rand(tokens, 2, generator=g)
    expert_weights = torch.randn(experts, 12, 12, generator=torch.Generator().manual_seed(99))
    return hidden, index, weights, expert_weights


def _check_route(rank: int, world: int, group=None, dtype=torch.float32):
    """``route_to_experts`` in ``dtype`` against the dense reference in float32 on the same rounded values."""
    hidden, index, weights, full = (t.to(dtype) if t.is_floating_point() else t for t in _route_case(rank, world))
    hidden.requires_grad_(True)
    weights.requires_grad_(True)
    local = full.shape[0] // world
    mine = full[rank * local:(rank + 1) * local].clone().requires_grad_(True)

    def run_local(rows, ids):
        out = torch.zeros(rows.shape, dtype=rows.dtype)
        for e in range(local):
            at = (ids == e).nonzero().flatten()
            out = out.index_add(0, at, torch.tanh(rows[at] @ mine[e]))
        return out + 0 * mine.sum()

    got = route_to_experts(hidden, index, weights, full.shape[0], run_local, group)
    assert got.dtype == dtype
    grad_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(5 + rank)).to(dtype)
    (got * grad_out).sum().backward()
    ref_hidden = hidden.detach().float().requires_grad_(True)
    ref_weights = weights.detach().float().requires_grad_(True)
    ref_full = full.float().requires_grad_(True)
    ref = _dense_route(ref_hidden, index, ref_weights, ref_full)
    (ref * grad_out.float()).sum().backward()
    _close(got, ref, dtype)
    _close(hidden.grad, ref_hidden.grad, dtype)
    _close(weights.grad, ref_weights.grad, dtype)
    return mine.grad.float(), ref_full.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_to_experts_one_rank_matches_dense_reference(dtype):
    expert_grad, ref_grad = _check_route(0, 1, dtype=dtype)
    _close(expert_grad, ref_grad, dtype)
    assert not ref_grad[1].any() and not ref_grad[6].any()  # the experts no token chose


# ------------------------------------------------------------------------------------------ spawned ranks

def _losses_and_grads(model, batch):
    out = model(batch, labels=batch)
    out.loss.backward()
    aux = getattr(out, "aux_loss", None)
    return out.loss.detach(), (aux.detach() if aux is not None else None)


def _family_errors(rank: int, world: int, family: str, experts: int = 8):
    import torch.distributed as dist

    import schedlang

    original = tiny_model(family, experts)
    batches = rank_batches(world)
    reference = copy.deepcopy(original)
    ref_losses = [_losses_and_grads(reference, b) for b in batches]  # gradients summed over every rank's batch
    sch = schedlang.create_schedule(original)
    sch.expert_parallel()
    model, _ = schedlang.build(sch)
    model = copy.deepcopy(model)  # a copy shares the group (Verify and build copy models)
    loss, aux = _losses_and_grads(model, batches[rank])
    errors = []

    def check(what, actual, expected):
        try:
            torch.testing.assert_close(actual, expected, **TOL)
        except AssertionError as e:
            errors.append(f"{family} rank {rank}: {what}: {str(e).splitlines()[0]}")

    check("loss", loss, ref_losses[rank][0])
    if ref_losses[rank][1] is not None:
        check("router aux loss", aux, ref_losses[rank][1])
    ref_params = dict(reference.named_parameters())
    expert_count = 0
    spread = expert_parameters(model)
    for name, p in model.named_parameters():
        ref = ref_params[name].grad
        if name in spread:
            if spread[name] != (world, rank, tuple(ref_params[name].shape)):
                errors.append(f"{family} rank {rank}: {name} recorded as {spread[name]}")
            expert_count += 1
            local = p.shape[0]
            check(f"{name} (this rank's experts)", p.grad, ref[rank * local:(rank + 1) * local])
            check(f"{name} weights untouched", p.detach(), ref_params[name].detach()[rank * local:(rank + 1) * local])
        else:
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            check(f"{name} (summed over ranks)", grad, ref if ref is not None else torch.zeros_like(p))
    if not expert_count:
        errors.append(f"{family}: no expert weight was spread")
    for name, p in original.named_parameters():  # the user's model keeps its full experts
        if p.shape != ref_params[name].shape:
            errors.append(f"{family}: the user's {name} changed shape to {tuple(p.shape)}")
    return errors


def _worker(rank: int, world: int):
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores

    for dtype in TOLS:
        expert_grad, ref_grad = _check_route(rank, world, dist.group.WORLD, dtype)
        dist.all_reduce(ref_grad)  # a local expert's gradient comes from every rank's tokens
        local = expert_grad.shape[0]
        _close(expert_grad, ref_grad[rank * local:(rank + 1) * local], dtype)
    errors = []
    for family in FAMILIES:
        errors += _family_errors(rank, world, family)
    errors += _training_errors(rank, world, ep=world)
    if world == 4:
        errors += _training_errors(rank, world, ep=2)
        errors += _uneven_refused(rank)
    return errors


def _training_errors(rank: int, world: int, ep: int, steps: int = 3):
    """Data parallelism over the world with experts spread over groups of ``ep`` ranks: SGD steps give the
    losses and weights of one process stepping on the mean of every rank's loss."""
    import torch.distributed as dist

    import schedlang

    ep_groups = [dist.new_group(list(range(g, g + ep))) for g in range(0, world, ep)]
    replica_groups = [dist.new_group(list(range(r, world, ep))) for r in range(ep)] if ep < world else None
    ep_group = ep_groups[rank // ep]
    replica_group = replica_groups[rank % ep] if replica_groups else None
    original = tiny_model("qwen3_moe", seed=3)
    reference = copy.deepcopy(original)
    batches = rank_batches(world)
    sch = schedlang.create_schedule(original)
    sch.expert_parallel(ep_group)
    model = sch.mod
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    errors = []
    for step in range(steps):
        ref_opt.zero_grad()
        ref_loss = sum(reference(b, labels=b).loss for b in batches) / world
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss = model(batches[rank], labels=batches[rank]).loss
        loss.backward()
        reduce_gradients(model, None, replica_group)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if not torch.allclose(mean / world, ref_loss.detach(), **TOL):
            errors.append(f"ep {ep} rank {rank} step {step}: mean loss {float(mean) / world} != {float(ref_loss)}")
    ref_params = dict(reference.named_parameters())
    ep_rank = rank % ep
    for name, p in model.named_parameters():
        want = ref_params[name].detach()
        if name in expert_parameters(model):
            local = p.shape[0]
            want = want[ep_rank * local:(ep_rank + 1) * local]
        if not torch.allclose(p.detach(), want, **TOL):
            errors.append(f"ep {ep} rank {rank}: {name} after {steps} steps differs by "
                          f"{float((p.detach() - want).abs().max())}")
    return errors


def _uneven_refused(rank: int):
    import schedlang
    from schedlang.errors import ShardError

    sch = schedlang.create_schedule(tiny_model("qwen3_moe", experts=6))
    try:
        sch.expert_parallel()
    except ShardError as e:
        want = ("model.layers.0.mlp.experts: cannot spread 6 experts over an expert-parallel group of 4 ranks: valid "
                "group sizes divide 6 (1, 2, 3, 6)")
        return [] if str(e) == want and len(sch.plan) == 0 else [f"rank {rank}: uneven refusal said {e}"]
    return [f"rank {rank}: 6 experts over 4 ranks were not refused"]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_families_match_one_process(world):
    results = run_distributed(_worker, world_size=world, timeout=170)
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, "\n".join(errors)


def _grouped_worker(rank: int, world: int):
    """The four families spread with the grouped products on (the Triton kernels interpreted on CPU under
    TRITON_INTERPRET=1, as the tests run): every block's local experts go through them, and the losses and
    gradients still follow one process running the families' own expert loops."""
    import schedlang.kernels.grouped_gemm_experts as grouped

    torch.set_num_threads(1)
    calls = []
    original = grouped.grouped_experts_forward

    def counted(experts, rows, counts, backend="auto"):
        calls.append(tuple(counts.tolist()))
        return original(experts, rows, counts, backend)

    grouped.grouped_experts_forward = counted
    errors = []
    try:
        for family in FAMILIES:
            before = len(calls)
            # 32 experts (Mixtral 16) for about 40 choices: some expert receives no row
            errors += _family_errors(rank, world, family, experts=32)
            if len(calls) == before:
                errors.append(f"{family} rank {rank}: the grouped products never ran")
    finally:
        grouped.grouped_experts_forward = original
    return errors, calls


def test_expert_parallel_grouped_products_match_one_process():
    results = run_distributed(_grouped_worker, world_size=2, timeout=170)
    errors = [e for per_rank, _ in results for e in per_rank]
    assert not errors, "\n".join(errors)
    # an expert that received no row from either rank ran in the same launch as the others
    assert any(0 in counts for _, calls in results for counts in calls)
