"""Data parallelism (FSDP2, DDP, HSDP) and its composition with tensor parallelism on device meshes.

Every layout trains a tiny LLaMA for a few AdamW steps in fp32 on gloo ranks and must give the
losses and weights of one process training on the whole batch. Each rank also runs that single
process reference itself (same seed, same batch), so nothing but the layout differs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import schedlang
from schedlang.distributed.mesh import make_mesh
from tests.helpers.distributed import run_distributed

STEPS = 3
LR = 1e-2
BATCH, SEQ = 4, 12


def _config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=128, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return cfg


def _device() -> torch.device:
    # gloo ranks here; one GPU per rank (NCCL) on a machine with enough GPUs
    # the group is "cpu:gloo,cuda:nccl" where every rank has a GPU
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).to(_device())


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (BATCH, SEQ + 1), generator=g).to(_device()) for _ in range(STEPS)]


def _train(model, optimizer, batches, rows=slice(None)):
    losses = []
    for tokens in batches:
        tokens = tokens[rows]
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().clone())
    return losses


def _full(t):
    from schedlang.checkpoint import full_tensor

    return full_tensor(t)  # block-wise (strided) shards too, on every torch version


def _reference():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [float(x) for x in _train(model, opt, _batches())]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _layout(dp, tp, kind, dp_replicate=1):
    """Train under one layout; returns (global losses, full parameters). ``dp_replicate=0``: a ("tp", "dp")
    mesh, tensor parallelism outermost (dimensions may come in any order)."""
    from torch.distributed.device_mesh import init_device_mesh

    from schedlang.models import shard_model

    tp_outer = dp_replicate == 0
    if tp_outer:
        dp_replicate = 1
        mesh = init_device_mesh(_device().type, (tp, dp), mesh_dim_names=("tp", "dp"))
    else:
        mesh = make_mesh(dp=dp, tp=tp, dp_replicate=dp_replicate, device_type=_device().type)
    sch = schedlang.create_schedule(_model(), mesh=mesh)
    policy = "fp32"  # the comparison is in fp32 (the GPU default would be bf16 parameters)
    if tp > 1:
        shard_model(sch, gather_logits=True)
    if kind == "fsdp":
        for i in range(2):
            sch[f"model.layers.{i}"].fully_shard(mp_policy=policy)
        sch.fully_shard(mp_policy=policy)
    elif kind == "ddp":
        sch.replicate(mp_policy=policy)
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=LR)
    data_ranks = dp * dp_replicate
    data_rank = dist.get_rank() % dp if tp_outer else dist.get_rank() // tp
    per = BATCH // data_ranks
    losses = _train(model, opt, _batches(), rows=slice(data_rank * per, (data_rank + 1) * per))
    global_losses = []
    for loss in losses:
        loss = loss * (1.0 / data_ranks)
        dist.all_reduce(loss)  # ranks of one tp group hold the same loss: count each data rank once
        global_losses.append(float(loss) / tp)
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    placements = {n: [type(pl).__name__ for pl in p.placements] for n, p in model.named_parameters()
                  if hasattr(p, "placements")}
    return global_losses, params, placements


def _worker(rank, world, layouts):
    ref_losses, ref_params = _reference()
    out = {}
    for name, (dp, tp, kind, dp_replicate) in layouts.items():
        losses, params, placements = _layout(dp, tp, kind, dp_replicate)
        worst = max(float((params[n] - ref_params[n]).abs().max()) for n in ref_params)
        out[name] = {"losses": losses, "ref": ref_losses, "param_diff": worst, "placements": placements}
    return out


def _check(results, name):
    for r in results:
        entry = r[name]
        torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(entry["ref"]), rtol=1e-5, atol=1e-5)
        # Adam divides by the gradient's root mean square, so a near-zero gradient summed in another order
        # can move its weight by a visible fraction of a step: bound at 1% of the farthest Adam can move
        # a weight in these steps (lr x steps); a wrong or missing gradient sum moves weights by whole steps
        assert entry["param_diff"] < 0.01 * LR * STEPS, entry["param_diff"]


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_worker, world_size=2, args=({"fsdp": (2, 1, "fsdp", 1), "ddp": (2, 1, "ddp", 1),
                                                          "tp_only": (1, 2, None, 1)},), timeout=240)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(_worker, world_size=4, args=({"fsdp_tp": (2, 2, "fsdp", 1), "ddp_tp": (2, 2, "ddp", 1),
                                                          "hsdp": (2, 1, "fsdp", 2),
                                                          "tp_outer": (2, 2, "fsdp", 0)},), timeout=300)


def test_fsdp2_on_two_ranks_trains_like_one_process(world2):
    _check(world2, "fsdp")
    placements = world2[0]["fsdp"]["placements"]
    assert placements["model.layers.0.mlp.up_proj.weight"] == ["Shard"]


def test_ddp_on_two_ranks_trains_like_one_process(world2):
    _check(world2, "ddp")
    assert world2[0]["ddp"]["placements"]["model.layers.0.mlp.up_proj.weight"] == ["Replicate"]


def test_tensor_parallel_parameters_are_dtensors_on_the_tp_dimension(world2):
    _check(world2, "tp_only")
    placements = world2[0]["tp_only"]["placements"]
    assert placements["model.layers.0.mlp.up_proj.weight"] == ["Shard"]        # column parallel
    assert placements["model.layers.0.mlp.down_proj.weight"] == ["Shard"]      # row parallel (axis 1)
    assert placements["model.layers.0.input_layernorm.weight"] == ["Replicate"]


def test_fsdp2_over_tensor_parallelism_on_a_2d_mesh(world4):
    _check(world4, "fsdp_tp")
    placements = world4[0]["fsdp_tp"]["placements"]
    # dp shards the tp shard again: one placement per mesh dimension
    assert len(placements["model.layers.0.mlp.up_proj.weight"]) == 2


def test_ddp_over_tensor_parallelism_on_a_2d_mesh(world4):
    _check(world4, "ddp_tp")


def test_mesh_dimensions_in_any_order(world4):
    _check(world4, "tp_outer")


def test_hybrid_sharded_data_parallel(world4):
    _check(world4, "hsdp")
    assert len(world4[0]["hsdp"]["placements"]["model.layers.0.mlp.up_proj.weight"]) == 2


# ---------------------------------------------------------------------------------------------- errors
def _errors_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = None
        except schedlang.SchedlangError as e:
            out[key] = (type(e).__name__, str(e))

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    tp_only = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    catch("no_dp_dim", lambda: schedlang.create_schedule(model, mesh=tp_only)["0"].fully_shard())
    catch("no_mesh", lambda: schedlang.create_schedule(model).fully_shard())
    dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    catch("no_params", lambda: schedlang.create_schedule(model, mesh=dp_mesh)["1"].fully_shard())

    def mixed():
        sch = schedlang.create_schedule(model, mesh=dp_mesh)
        sch["0"].fully_shard()
        sch.replicate()

    catch("mixed", mixed)

    def twice():
        sch = schedlang.create_schedule(model, mesh=dp_mesh)
        sch["0"].fully_shard()
        sch["0"].fully_shard()

    catch("twice", twice)
    catch("bad_policy", lambda: schedlang.create_schedule(model, mesh=dp_mesh).fully_shard(mp_policy="fp8"))
    catch("bad_reshard", lambda: schedlang.create_schedule(model, mesh=dp_mesh).fully_shard(reshard_after_forward=0))
    catch("bad_dim", lambda: schedlang.create_schedule(model, mesh=init_device_mesh(
        "cpu", (2,), mesh_dim_names=("data",))))
    catch("both", lambda: schedlang.create_schedule(model, group=dist.group.WORLD, mesh=dp_mesh))
    catch("world", lambda: make_mesh(dp=3))
    # a replayed plan keeps the data-parallel steps (JSON round trip)
    sch = schedlang.create_schedule(model, mesh=dp_mesh)
    sch["0"].fully_shard(mp_policy="bf16", reshard_after_forward=False)
    replayed = schedlang.replay(sch.plan.to_json(), model, mesh=dp_mesh)
    out["replayed"] = [(s.primitive, s.path, s.args) for s in replayed.plan]
    out["model_untouched"] = type(model[0]).__name__
    return out


@pytest.fixture(scope="module")
def errors():
    return run_distributed(_errors_worker, world_size=2, timeout=120)[0]


@pytest.mark.parametrize("key,kind,text", [
    ("no_dp_dim", "ScheduleValueError", "0: fully_shard needs a data-parallel mesh dimension; this mesh has ('tp',)"),
    ("no_mesh", "ScheduleValueError", "<root>: fully_shard runs on the mesh's data-parallel dimension, and this "
                                      "schedule has no mesh"),
    ("no_params", "ScheduleValueError", "1: ReLU holds no parameters"),
    ("mixed", "ScheduleValueError", "<root>: the schedule already has fully_shard (at '0')"),
    ("twice", "ScheduleValueError", "0: fully_shard was already applied here"),
    ("bad_policy", "ScheduleValueError", "mp_policy 'fp8' is not known: valid names are 'bf16'"),
    ("bad_reshard", "ScheduleValueError", "reshard_after_forward as a group size must be >= 1, got 0"),
    ("bad_dim", "ScheduleValueError", "unknown mesh dimension name(s) 'data': valid names are pp, dp_replicate"),
    ("both", "ScheduleTypeError", "give either group="),
    ("world", "ScheduleValueError", "= 3 ranks, but the world has 2"),
])
def test_errors_name_the_path_the_value_and_what_is_valid(errors, key, kind, text):
    assert errors[key] is not None, f"{key}: no error raised"
    assert errors[key][0] == kind
    assert text in errors[key][1]


def test_data_parallel_steps_replay_from_json(errors):
    assert errors["replayed"] == [("fully_shard", "0", {"reshard_after_forward": False, "offload": False,
                                                        "mp_policy": {"param_dtype": "bfloat16",
                                                                      "reduce_dtype": "float32",
                                                                      "output_dtype": None,
                                                                      "cast_forward_inputs": True}})]
    assert errors["model_untouched"] == "Linear"


def test_single_process_without_torch_distributed_skips_data_parallel_steps():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    sch = schedlang.create_schedule(model)
    sch.fully_shard()
    built, _ = schedlang.build(sch)
    x = torch.randn(3, 4)
    torch.testing.assert_close(built(x), model(x))


def _accumulated_gradients(rank, world, master_weights):
    """On each rank: two microbatches of this rank's rows with the replicas' gradient sync off for the first
    (``set_gradient_sync``); the gradient all-reduces the step issued, the units switched, and the gradients."""
    from unittest import mock

    from schedlang.distributed.data_parallel import set_gradient_sync

    sch = schedlang.create_schedule(_model(), mesh=make_mesh(dp=world, device_type="cpu"))
    sch.replicate()
    if master_weights:  # torch's DDP-based replicate over the optimizer's bf16 copies
        model, _ = schedlang.build(sch, optimizer="adamw", master_weights=True, lr=LR)
    else:  # the FSDP-based replicate
        model, _ = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=LR)
    tokens = _batches()[0][rank * BATCH // world:(rank + 1) * BATCH // world]
    reductions = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if tensor.numel() > 1:
            reductions.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    units = []
    with mock.patch.object(dist, "all_reduce", counting):
        for k, rows in enumerate(tokens.chunk(2)):
            units.append(set_gradient_sync(model, k == 1))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master_weights):  # bf16 weights: bf16 matmuls
                loss = model(input_ids=rows[:, :-1], labels=rows[:, 1:], use_cache=False).loss / 2
            loss.backward()
    grads = {n: _full(p.grad).detach().float().clone() for n, p in model.named_parameters()}
    return reductions, units, grads


@pytest.mark.parametrize("master_weights", [False, True], ids=["fsdp-replicate", "ddp-replicate"])
def test_gradient_sync_off_defers_the_reduction_to_the_last_microbatch(master_weights):
    """Both replicate engines skip the all-reduce of a microbatch run with the sync off and reduce the summed
    gradients with the last one: the ranks end with the same gradients, after one reduction per bucket."""
    results = run_distributed(_accumulated_gradients, world_size=2, timeout=300, args=(master_weights,))
    for reductions, units, _ in results:
        assert units == [1, 1]  # one unit, at the root, switched off then on
        assert len(reductions) >= 1
        # one step's buckets, each reduced once: the gradient elements reduced are the parameters' count
        assert sum(reductions) == sum(g.numel() for g in results[0][2].values())
    (_, _, first), (_, _, second) = results
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0, msg=name)
