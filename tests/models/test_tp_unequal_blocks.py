"""Fused tensors split in blocks of unequal widths (``ShardSpec.blocks``): Phi-3's ``qkv_proj`` with fewer
key/value heads than query heads, whose q, k and v parts are each split over the ranks.

One process plays every rank (the split needs no collectives): the slices, the fused shard of each
rank, the rank-major order a built model's DTensor holds, and a meta-device build whose shards equal
the slices of the unsharded build. The two-rank ``Verify`` of the whole model is in
``test_tp_families.py``.

One spawned run on two gloo ranks builds the tensor-parallel model (the q|k|v weight a DTensor laid
out rank-major) and checks what reads its global value: loss, gradients and a training step against
the single-device model, ``full_tensor``, ``export_hf``, a DCP checkpoint saved at TP=2 and loaded
in one process (and the reverse), and ``build(pretrained=...)`` of a meta-device model.
"""

import contextlib
import copy
import os
from unittest import mock

import pytest
import torch

import schedlang
import schedlang.distributed.groups as groups
from schedlang.distributed.launch import run_distributed
from schedlang.distributed.sharding import ShardSpec, shard_specs, shard_tensor
from schedlang.models import shard_model
from tests.models import tp_checks as T

LR = 1e-2


@contextlib.contextmanager
def fake_group(world, rank):
    with mock.patch.object(groups, "world_size", lambda group=None: world), \
            mock.patch.object(groups, "rank", lambda group=None: rank):
        yield


@pytest.mark.parametrize("blocks,world,axis", [((8, 4, 4), 2, 0), ((12, 4, 4), 4, 1), ((6, 3), 3, 0)])
def test_each_block_is_split_on_its_own(blocks, world, axis):
    full = torch.randn(sum(blocks), 7) if axis == 0 else torch.randn(5, sum(blocks))
    pieces = []
    for rank in range(world):
        spec = ShardSpec(axis, world, rank, tuple(full.shape), blocks=blocks)
        assert spec.groups == len(blocks) and spec.block_sizes(full.shape[axis]) == blocks
        piece = spec.slice_of(full)
        assert torch.equal(piece, shard_tensor(full, axis, rank, world, blocks=blocks))
        assert piece.shape[axis] == sum(blocks) // world
        pieces.append(piece)
    # block b of rank r is rows [start_b + r * size_b, ...) of the full tensor
    start = 0
    for i, block in enumerate(blocks):
        size = block // world
        offset = sum(b // world for b in blocks[:i])
        for rank, piece in enumerate(pieces):
            assert torch.equal(piece.narrow(axis, offset, size), full.narrow(axis, start + rank * size, size))
        start += block
    # equal blocks give what groups gives
    equal = ShardSpec(axis, world, 1, tuple(full.shape), groups=len(blocks))
    same = ShardSpec(axis, world, 1, tuple(full.shape), blocks=(sum(blocks) // len(blocks),) * len(blocks))
    assert sum(blocks) % len(blocks) or torch.equal(equal.slice_of(full), same.slice_of(full))


def test_meta_build_of_phi3_with_grouped_query_attention_equals_slices_of_the_unsharded_build():
    import transformers

    cfg = T.family_config("phi3_gqa")
    with schedlang.init_empty_weights():
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(5)
    full = schedlang.build(schedlang.create_schedule(meta), device="cpu")[0]
    full_params = dict(full.named_parameters(remove_duplicate=False))
    for rank in range(2):
        with fake_group(2, rank):
            sch = schedlang.create_schedule(meta)
            shard_model(sch)
            torch.manual_seed(5)
            model = schedlang.build(sch, device="cpu")[0]
        qkv = shard_specs(model.model.layers[0].self_attn.qkv_proj)["weight"]
        assert qkv.blocks == (64, 32, 32) and model.model.layers[0].self_attn.qkv_proj.weight.shape == (64, 64)
        for mod_name, module in model.named_modules(remove_duplicate=False):
            specs = shard_specs(module)
            for name, p in module.named_parameters(recurse=False):
                ref = full_params[f"{mod_name}.{name}" if mod_name else name]
                expected = specs[name].slice_of(ref) if name in specs else ref
                assert torch.equal(p, expected), f"{mod_name}.{name} on rank {rank}"


@pytest.mark.parametrize("blocks,world", [((64, 32, 32), 2), ((12, 4, 4), 4), ((6, 3), 3)])
def test_rank_major_order_puts_each_rank_shard_in_one_chunk(blocks, world):
    full = torch.randn(sum(blocks), 5)
    spec = ShardSpec(0, world, 0, tuple(full.shape), blocks=blocks)
    assert spec.rank_major and not ShardSpec(0, world, 0, (12, 5), blocks=(4, 4, 4)).rank_major
    order = spec.rank_major_order()
    assert sorted(order.tolist()) == list(range(sum(blocks)))  # a permutation
    rank_major = full.index_select(0, order)
    for rank, chunk in enumerate(rank_major.chunk(world)):
        assert torch.equal(chunk, ShardSpec(0, world, rank, tuple(full.shape), blocks=blocks).slice_of(full))
    from schedlang.distributed.dtensor_params import to_rank_major, to_unsharded

    assert torch.equal(to_rank_major(full, spec), rank_major) and torch.equal(to_unsharded(rank_major, spec), full)


# ---------------------------------------------------------------------------------------------- two ranks
SEQ = 11


def _batch():
    ids = torch.randint(2, T.VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def _phi3(seed):
    torch.manual_seed(seed)
    return T.family_model("phi3_gqa")[0]


def _logits(model):
    from schedlang.distributed.collectives import all_gather_tensor

    with torch.no_grad():
        logits = model(input_ids=_batch()["input_ids"]).logits
    if logits.shape[-1] != T.VOCAB:  # the vocabulary-parallel head: gather the vocabulary
        logits = all_gather_tensor(logits.contiguous(), -1)
    return logits


def _full_params(model):
    from schedlang.checkpoint import full_tensor

    return {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def _exp_avg(model, opt, path):
    """The optimizer's exp_avg of the parameter at ``path``, unsharded (its spec from the module record)."""
    from schedlang.checkpoint import full_tensor

    module, _, name = path.rpartition(".")
    p = model.get_submodule(module).get_parameter(name)
    return full_tensor(opt.state[p]["exp_avg"], shard_specs(model.get_submodule(module)).get(name)).clone()


QKV = "model.layers.0.self_attn.qkv_proj"


def _build_tp(model, **kw):
    sch = schedlang.create_schedule(model, mesh=T.tp_mesh())  # DTensor parameters: placements are checked
    shard_model(sch)
    return schedlang.build(sch, **kw)


def _spawned(rank, world, root):
    from transformers import AutoModelForCausalLM

    from schedlang.checkpoint import full_tensor

    out = {}
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "orig"))
    # -- build: the q|k|v weight is a DTensor whose rows are rank-major; full_tensor gives the unsharded weight
    model, opt = _build_tp(copy.deepcopy(hf), optimizer=torch.optim.AdamW, lr=LR)
    qkv = model.get_submodule(QKV).weight
    out["placements"] = [(type(p).__name__, p.dim) for p in qkv.placements]
    out["local_rows"] = qkv.to_local().shape[0]
    out["qkv_unsharded"] = torch.equal(full_tensor(qkv), hf.get_submodule(QKV).weight)
    schedlang.export_hf(model, os.path.join(root, "hf"))
    # -- loss and gradients against the single-device model, then one AdamW step on both
    reference = copy.deepcopy(hf)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    out["compare"] = T.compare(model, reference, _batch(), logits_split=True)
    opt.step()
    ref_opt.step()
    params = _full_params(model)
    ref_params = dict(reference.named_parameters())
    out["step_diff"] = max(float((params[n] - ref_params[n]).detach().abs().max()) for n in params)
    out["exp_avg_diff"] = float((_exp_avg(model, opt, f"{QKV}.weight")
                                 - ref_opt.state[ref_params[f"{QKV}.weight"]]["exp_avg"]).abs().max())
    schedlang.save_checkpoint(os.path.join(root, "tp"), model, opt, step=1)
    out["tp_saved"] = {"params": params, "exp_avg": _exp_avg(model, opt, f"{QKV}.weight"), "logits": _logits(model)}
    # -- a one-process checkpoint loads at TP=2 (into other initial weights)
    model, opt = _build_tp(_phi3(seed=9), optimizer=torch.optim.AdamW, lr=LR)
    schedlang.load_checkpoint(os.path.join(root, "one"), model, opt)
    out["from_one"] = {"params": _full_params(model), "exp_avg": _exp_avg(model, opt, f"{QKV}.weight"),
                       "logits": _logits(model)}
    # -- a meta-device model built from the safetensors gives from_pretrained's loss and gradients
    import transformers

    with schedlang.init_empty_weights():
        meta = transformers.AutoModelForCausalLM.from_config(T.family_config("phi3_gqa"))
    model, _ = _build_tp(meta, pretrained=os.path.join(root, "orig"), device="cpu")  # beside the CPU reference
    out["pretrained"] = T.compare(model, copy.deepcopy(hf), _batch(), logits_split=True)
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))
    return os.path.join(root, f"rank{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("phi3_gqa"))
    original = _phi3(seed=0)
    original.save_pretrained(os.path.join(root, "orig"))
    # a one-process checkpoint after one step, for the ranks to load at TP=2
    one = _phi3(seed=4)
    opt = torch.optim.AdamW(one.parameters(), lr=LR)
    one(**_batch()).loss.backward()
    opt.step()
    schedlang.save_checkpoint(os.path.join(root, "one"), one, opt, step=1)
    files = run_distributed(_spawned, world_size=2, args=(root,), timeout=300)
    one_state = {"params": {n: p.detach().clone() for n, p in one.named_parameters()},
                 "exp_avg": opt.state[one.get_submodule(QKV).weight]["exp_avg"].clone(), "logits": _logits(one)}
    return {"root": root, "original": original, "one": one_state,
            "ranks": [torch.load(f, weights_only=True) for f in files]}


def test_tensor_parallel_build_is_rank_major_and_matches_the_single_device_model(spawned):
    for r in spawned["ranks"]:
        assert r["placements"] == [("Shard", 0)] and r["local_rows"] == 64  # [q_r, k_r, v_r]: 32 + 16 + 16
        assert r["qkv_unsharded"]
        T.assert_matches(r["compare"])
        assert r["compare"]["grads_compared"] == len(list(spawned["original"].parameters()))
        # Adam divides by the root of tiny squared gradients on its first step: differences of rounding grow to
        # about 1e-3 of the learning rate (a misplaced row would differ by the size of the weights, ~1e-2)
        assert r["step_diff"] < 1e-2 * LR and r["exp_avg_diff"] < 1e-7, {k: r[k] for k in ("step_diff", "exp_avg_diff")}


def test_export_hf_writes_the_original_state_dict(spawned):
    from safetensors.torch import load_file

    exported = load_file(os.path.join(spawned["root"], "hf", "model.safetensors"))
    original = spawned["original"].state_dict()
    assert set(exported) == set(original)
    for name, value in original.items():
        assert torch.equal(exported[name], value), name


def test_checkpoint_saved_at_tp2_loads_in_one_process(spawned):
    saved = spawned["ranks"][0]["tp_saved"]
    model = _phi3(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    info = schedlang.load_checkpoint(os.path.join(spawned["root"], "tp"), model, opt)
    assert info["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(p, saved["params"][name]), name
    assert torch.equal(opt.state[model.get_submodule(QKV).weight]["exp_avg"], saved["exp_avg"])
    torch.testing.assert_close(_logits(model), saved["logits"], rtol=1e-5, atol=1e-5)


def test_checkpoint_saved_in_one_process_loads_at_tp2(spawned):
    one = spawned["one"]
    for r in spawned["ranks"]:
        loaded = r["from_one"]
        for name, value in one["params"].items():
            assert torch.equal(loaded["params"][name], value), name
        assert torch.equal(loaded["exp_avg"], one["exp_avg"])
        torch.testing.assert_close(loaded["logits"], one["logits"], rtol=1e-5, atol=1e-5)


def test_meta_model_built_from_safetensors_gives_the_loss_of_from_pretrained(spawned):
    for r in spawned["ranks"]:
        T.assert_matches(r["pretrained"])


# ---------------------------------------------------------------------------------------------- FSDP2 x TP
def _dp_tp_schedule(model):
    from schedlang.distributed.mesh import make_mesh

    sch = schedlang.create_schedule(model, mesh=make_mesh(dp=2, tp=2, device_type="cpu"))
    shard_model(sch, gather_logits=True)
    for i in range(2):
        sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
    sch.fully_shard(mp_policy="fp32")
    return sch


def _spawned_dp_tp(rank, world, root):
    """FSDP2 over tensor parallelism (2 x 2 ranks): FSDP2 splits the rank-major q|k|v shard and the block-wise
    gate|up shard again; train a step, save, export, load back into other weights and build from the export."""
    import transformers
    from transformers import AutoModelForCausalLM

    from schedlang.checkpoint import full_tensor

    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "orig"))
    model, opt = schedlang.build(_dp_tp_schedule(copy.deepcopy(hf)), optimizer=torch.optim.AdamW, lr=LR)
    out = {"qkv_unsharded": torch.equal(full_tensor(model.get_submodule(QKV).weight), hf.get_submodule(QKV).weight)}
    reference = copy.deepcopy(hf)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    out["compare"] = T.compare(model, reference, _batch(), logits_split=False)  # every dp rank: the same batch
    opt.step()
    ref_opt.step()
    params = _full_params(model)
    ref_params = dict(reference.named_parameters())
    out["step_diff"] = max(float((params[n] - ref_params[n]).detach().abs().max()) for n in params)
    schedlang.save_checkpoint(os.path.join(root, "dp_tp"), model, opt, step=1)
    schedlang.export_hf(model, os.path.join(root, "dp_tp_hf"))
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    saved = {"params": params, "exp_avg": [_exp_avg(model, opt, f"{QKV}.weight"), _exp_avg(model, opt, gate_up)]}
    model, opt = schedlang.build(_dp_tp_schedule(_phi3(seed=8)), optimizer=torch.optim.AdamW, lr=LR)
    schedlang.load_checkpoint(os.path.join(root, "dp_tp"), model, opt)
    reloaded = _full_params(model)
    out["reloaded"] = [n for n in params if not torch.equal(reloaded[n], params[n])]
    out["exp_avg_reloaded"] = all(torch.equal(a, b) for a, b in zip(
        [_exp_avg(model, opt, f"{QKV}.weight"), _exp_avg(model, opt, gate_up)], saved["exp_avg"]))
    with schedlang.init_empty_weights():
        meta = transformers.AutoModelForCausalLM.from_config(T.family_config("phi3_gqa"))
    model, _ = schedlang.build(_dp_tp_schedule(meta), pretrained=os.path.join(root, "dp_tp_hf"))
    built = _full_params(model)
    out["from_export"] = [n for n in params if not torch.equal(built[n], params[n])]
    out["params"] = params
    torch.save(out, os.path.join(root, f"dp_tp_rank{rank}.pt"))
    return os.path.join(root, f"dp_tp_rank{rank}.pt")


def test_fsdp2_over_tensor_parallel_trains_saves_exports_and_loads_on_four_ranks(tmp_path):
    from safetensors.torch import load_file

    _phi3(seed=0).save_pretrained(tmp_path / "orig")
    files = run_distributed(_spawned_dp_tp, world_size=4, args=(str(tmp_path),), timeout=300)
    ranks = [torch.load(f, weights_only=True) for f in files]
    for r in ranks:
        assert r["qkv_unsharded"]
        T.assert_matches(r["compare"])
        assert r["step_diff"] < 1e-2 * LR, r["step_diff"]  # see the two-rank test
        assert r["reloaded"] == [] and r["exp_avg_reloaded"] and r["from_export"] == []
    params = ranks[0]["params"]
    model = _phi3(seed=5)
    schedlang.load_checkpoint(tmp_path / "dp_tp", model)
    exported = load_file(tmp_path / "dp_tp_hf" / "model.safetensors")
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]) and torch.equal(exported[name], params[name]), name
