"""``replicate`` with fp32 master weights: DDP over plain bf16 parameters.

Two gloo ranks train a tiny LLaMA under bf16 autocast, each on half of the batch, with
``build(..., optimizer="adamw", master_weights=True)``. The ranks must end with bit-identical
masters (the gradients were summed), close to one process training on the whole batch with master
weights, and the communication hook must sum bf16 buckets in fp32 (or in bf16 when asked).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import schedlang
from schedlang.distributed.mesh import make_mesh
from tests.distributed.test_data_parallel import _config  # the same tiny LLaMA
from tests.helpers.distributed import run_distributed

STEPS = 3
LR = 1e-2
BATCH, SEQ = 4, 12


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _step(model, opt, tokens) -> float:
    """One training step under bf16 autocast on ``tokens`` (ids and, shifted by one, labels); its loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _train(model, opt, rows):
    return [_step(model, opt, tokens[rows]) for tokens in _batches()]


def _my_rows():
    """This rank's half of the batch."""
    per = BATCH // 2
    return slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)


def _out(t: torch.Tensor):
    """A tensor as it crosses back from a rank: numpy, pickled by value (bf16 widened to fp32 exactly)."""
    return t.detach().float().numpy().copy()


def _masters(model, opt):
    return {name: _out(t) for name, t in opt.master_state_dict(model).items()}


def _reference():
    """One process, the whole batch, master weights."""
    model, opt = schedlang.build(schedlang.create_schedule(_model()), optimizer="adamw", master_weights=True, lr=LR)
    return _train(model, opt, slice(None)), _masters(model, opt)


def _build_ddp(nested: bool = False, mp_policy=None):
    sch = schedlang.create_schedule(_model(), mesh=make_mesh(dp=2, device_type="cpu"))
    if nested:  # a replicate per layer under the root's: one DDP at the root covers them
        for i in range(2):
            sch[f"model.layers.{i}"].replicate(mp_policy=mp_policy)
    sch.replicate(mp_policy=mp_policy)
    return schedlang.build(sch, optimizer="adamw", master_weights=True, lr=LR)


def _data_parallel(nested: bool = False, mp_policy=None):
    model, opt = _build_ddp(nested, mp_policy)
    weight = model.model.layers[0].mlp.up_proj.weight
    kinds = {"linear": (type(weight.data).__name__, str(weight.dtype)),
             "norm": str(model.model.norm.weight.dtype)}
    losses = _train(model, opt, _my_rows())
    from torch.distributed._composable import replicate

    ddp_at = [name for name, m in model.named_modules() if getattr(replicate.state(m), "_ddp", None) is not None]
    return {"losses": losses, "masters": _masters(model, opt), "kinds": kinds, "ddp_at": ddp_at}


class _Bucket:
    """What DDP hands a communication hook, as far as the hook reads it."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer


def _hook_sums(rank):
    """The hook on a bf16 bucket whose fp32 mean and bf16 mean differ, in fp32 and as it is."""
    from schedlang.distributed.data_parallel import ReduceState, reduce_in_dtype

    g = torch.Generator().manual_seed(3 + rank)
    local = (torch.randn(257, generator=g) * (1 + 1000 * rank)).to(torch.bfloat16)
    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local)
    out = {"locals": [_out(t) for t in gathered]}
    for name, dtype in (("fp32", torch.float32), ("as_is", None)):
        buffer = local.clone()
        result = reduce_in_dtype(ReduceState(dist.group.WORLD, dtype), _Bucket(buffer)).wait()
        out[name] = (_out(result), _out(buffer), str(result.dtype))
        out[name + ":in_bucket"] = result.data_ptr() == buffer.data_ptr()
    fp32_bucket = local.float()
    result = reduce_in_dtype(ReduceState(dist.group.WORLD, torch.float32), _Bucket(fp32_bucket)).wait()
    out["fp32_bucket"] = (_out(result), str(result.dtype))
    return out


def _resume(checkpoint):
    """Train two steps, save, train one more; a fresh DDP model and optimizer loaded from the checkpoint must
    take the same third step, bit for bit (the masters, both moments and the step count come back)."""
    rows = _my_rows()
    batches = _batches()

    model, opt = _build_ddp()
    for tokens in batches[:2]:
        _step(model, opt, tokens[rows])
    schedlang.save_checkpoint(checkpoint, model, opt, step=2)
    straight = _step(model, opt, batches[2][rows])
    fresh, fresh_opt = _build_ddp()
    info = schedlang.load_checkpoint(checkpoint, fresh, fresh_opt)
    resumed = _step(fresh, fresh_opt, batches[2][rows])
    a, b = _masters(model, opt), _masters(fresh, fresh_opt)
    return {"step": info["step"], "losses": (straight, resumed), "same_masters": all((a[n] == b[n]).all() for n in a)}


def _worker(rank, world, checkpoint):
    out = {"reference": _reference(), "default": _data_parallel(), "nested": _data_parallel(nested=True),
           "bf16_reduce": _data_parallel(mp_policy={"reduce_dtype": "bfloat16"}), "hook": _hook_sums(rank),
           "resume": _resume(checkpoint)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    checkpoint = str(tmp_path_factory.mktemp("ddp-master-weights") / "ckpt")
    return run_distributed(_worker, world_size=2, args=(checkpoint,), timeout=240)


def test_a_checkpoint_resumes_ddp_over_master_weights_exactly(runs):
    for r in runs:
        assert r["resume"]["step"] == 2
        straight, resumed = r["resume"]["losses"]
        assert straight == resumed
        assert r["resume"]["same_masters"]


def test_parameters_stay_plain_bf16_tensors_and_one_ddp_runs_at_the_root(runs):
    for r in runs:
        assert r["default"]["kinds"] == {"linear": ("Tensor", "torch.bfloat16"), "norm": "torch.float32"}
        assert r["default"]["ddp_at"] == [""]
        assert r["nested"]["ddp_at"] == [""]  # the layers' replicate steps are covered by the root's


@pytest.mark.parametrize("run", ["default", "nested", "bf16_reduce"])
def test_ranks_hold_identical_masters_after_training(runs, run):
    a, b = runs[0][run]["masters"], runs[1][run]["masters"]
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name


@pytest.mark.parametrize("run", ["default", "nested", "bf16_reduce"])
def test_two_ranks_train_like_one_process_on_the_whole_batch(runs, run):
    ref_losses, ref_masters = runs[0]["reference"]
    # the global loss: the mean of the ranks' losses over equal halves of the batch
    losses = [(x + y) / 2 for x, y in zip(runs[0][run]["losses"], runs[1][run]["losses"])]
    # bf16 autocast: half-batch gradients are rounded to bf16 before they are summed, the whole batch's after
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=0)
    masters = runs[0][run]["masters"]
    # Adam divides by the gradient's root mean square, so where a gradient is near zero its bf16 rounding (of a
    # half batch's gradient here, of the whole batch's there) can flip a step: bound the share of weights that
    # moved apart by half a step or more. Each rank training on its own half (no gradient sum) moves 63% of them.
    total = sum(m.size for m in ref_masters.values())
    far = sum(int((abs(masters[n] - ref_masters[n]) > 0.5 * LR).sum()) for n in ref_masters)
    assert far / total < 0.01, far / total


def _bf16(array):
    return torch.from_numpy(array).to(torch.bfloat16)


def test_hook_sums_bf16_buckets_in_fp32_and_rounds_once(runs):
    for r in runs:
        a, b = (_bf16(x) for x in r["hook"]["locals"])
        result, buffer, dtype = r["hook"]["fp32"]
        expected = ((a.float() / 2) + (b.float() / 2)).to(torch.bfloat16)
        assert dtype == "torch.bfloat16"
        assert torch.equal(_bf16(result), expected)
        # written back into DDP's bucket, which holds the gradients (gradient_as_bucket_view)
        assert r["hook"]["fp32:in_bucket"] and torch.equal(_bf16(buffer), expected)


def test_hook_sums_in_the_buckets_dtype_when_asked(runs):
    for r in runs:
        a, b = (_bf16(x) for x in r["hook"]["locals"])
        result, _, dtype = r["hook"]["as_is"]
        expected = (a / 2) + (b / 2)  # bf16 arithmetic, as DDP's default hook
        assert dtype == "torch.bfloat16"
        assert torch.equal(_bf16(result), expected)
        # summed in place in the bucket, no wider copy. (Over two ranks the two sums agree bit for bit: halving is
        # exact and the sum of two bf16 values is rounded once either way; they part from three ranks on.)
        assert r["hook"]["as_is:in_bucket"]


def test_hook_leaves_fp32_buckets_as_ddp_would(runs):
    for r in runs:
        a, b = (torch.from_numpy(x) for x in r["hook"]["locals"])
        result, dtype = r["hook"]["fp32_bucket"]
        assert dtype == "torch.float32"
        torch.testing.assert_close(torch.from_numpy(result), a / 2 + b / 2, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- errors
def _errors_worker(rank, world):
    out = {}

    def catch(key, fn):
        model = _model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            fn(model)
            out[key] = None
        except schedlang.SchedlangError as e:
            out[key] = (type(e).__name__, str(e))
        # nothing half-applied: the user's model is untouched
        out[key + ":untouched"] = all(p.dtype == torch.float32 and torch.equal(p, before[n])
                                      for n, p in model.named_parameters()) and type(model).__name__ == \
            "LlamaForCausalLM"

    mesh = make_mesh(dp=2, device_type="cpu")

    def fsdp(model):
        sch = schedlang.create_schedule(model, mesh=mesh)
        sch["model.layers.0"].fully_shard()
        schedlang.build(sch, optimizer="adamw", master_weights=True)

    def policy(spec):
        def fn(model):
            sch = schedlang.create_schedule(model, mesh=mesh)
            sch.replicate(mp_policy=spec)
            schedlang.build(sch, optimizer="adamw", master_weights=True)
        return fn

    def tensor_parallel(model):
        from schedlang.models import shard_model

        # with a mesh the shards become DTensors (without one they stay plain local shards, which the masters keep)
        sch = schedlang.create_schedule(model, mesh=make_mesh(tp=2, device_type="cpu"))
        shard_model(sch)
        schedlang.build(sch, optimizer="adamw", master_weights=True)

    catch("fsdp", fsdp)
    catch("param_dtype", policy({"param_dtype": "float32"}))
    catch("output_dtype", policy({"output_dtype": "bfloat16"}))
    catch("tensor_parallel", tensor_parallel)
    return out


@pytest.fixture(scope="module")
def errors():
    return run_distributed(_errors_worker, world_size=2, timeout=120)[0]


@pytest.mark.parametrize("key,text", [
    ("fsdp", "build: master_weights=True keeps plain bf16 parameters with fp32 masters in the optimizer, but the plan "
             "has fully_shard at 'model.layers.0'"),
    ("param_dtype", "<root>: replicate: mp_policy param_dtype=float32 contradicts master_weights with compute_dtype "
                    "torch.bfloat16"),
    ("output_dtype", "mp_policy output_dtype=bfloat16 is FSDP2's cast of the module output"),
    ("tensor_parallel", "build: master_weights=True keeps plain parameters, but the plan shards"),
])
def test_layouts_master_weights_cannot_keep_are_refused_before_anything_changes(errors, key, text):
    assert errors[key] is not None, f"{key}: no error raised"
    assert errors[key][0] == "ScheduleValueError"
    assert text in errors[key][1]
    assert errors[key + ":untouched"]


def test_a_two_dimensional_data_mesh_is_refused_for_master_weights():
    from schedlang.distributed.data_parallel import check_master_weights_layout

    class HybridMesh:  # what the check reads of an HSDP mesh ("dp_replicate" x "dp_shard")
        ndim = 2
        mesh_dim_names = ("dp_replicate", "dp_shard")

    with pytest.raises(schedlang.ScheduleValueError,
                       match=r"^build: master_weights=True runs replicate at '<root>' on DDP, which takes a 1-D data "
                             r"mesh; this one has dimensions \('dp_replicate', 'dp_shard'\); use a mesh with one 'dp' "
                             r"dimension, or master_weights=False$"):
        check_master_weights_layout([("replicate", "", {"mp_policy": None})], HybridMesh())
