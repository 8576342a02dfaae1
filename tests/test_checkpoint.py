"""Distributed checkpoints that load under another layout, and HuggingFace export.

One spawned run on two gloo ranks trains a tiny LLaMA under tensor parallelism and under FSDP2,
saves both, loads each into the *other* layout and trains on; the steps after the load must be the
steps a single process takes without ever saving. The same run saves a pipeline-like model (each
rank holding different names), a tensor-parallel GPT-2 (fused q|k|v, block-wise shards) and exports
the tensor-parallel LLaMA to a HuggingFace directory; the test process then loads those into plain
single-process models and compares.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from torch import nn

import schedlang
from schedlang.distributed.launch import run_distributed
from tests.helpers.hf_models import gpt2_config, llama, llama_config, token_batches
from tests.helpers.models import MLP, Stack

LR = 1e-2
BATCH, SEQ, VOCAB = 4, 10, 256


def _llama_config(tie=False):
    return llama_config(tie_word_embeddings=tie)


def _llama(seed=0, tie=False):
    return llama(seed, tie_word_embeddings=tie)


def _batches(n=4):
    return token_batches(n, BATCH, SEQ, VOCAB, seed=7)


def _train(model, opt, batches, rows=slice(None)):
    losses = []
    for tokens in batches:
        tokens = tokens[rows]
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    return losses


def _full(t):
    from schedlang.checkpoint import full_tensor

    return full_tensor(t)


def _full_params(model):
    return {n: _full(p).detach().clone() for n, p in model.named_parameters()}


def _full_optim(model, opt):
    """exp_avg / exp_avg_sq / step per parameter name, unsharded."""
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {k: _full(v).detach().clone() for k, v in st.items()} for p, st in opt.state.items()}


def _probe():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------------------------------------- the spawned run
def _layout_model(kind, seed):
    """A tiny LLaMA built by schedlang under ``kind`` ("tp" or "fsdp") on the two ranks."""
    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model

    mesh = make_mesh(tp=2, device_type="cpu") if kind == "tp" else make_mesh(dp=2, device_type="cpu")
    sch = schedlang.create_schedule(_llama(seed), mesh=mesh)
    if kind == "tp":
        shard_model(sch, gather_logits=True)
    else:
        for i in range(2):
            sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
    return schedlang.build(sch, optimizer=torch.optim.AdamW, lr=LR)


def _global_losses(losses, kind):
    import torch.distributed as dist

    if kind == "tp":  # both ranks saw the whole batch
        return [float(x) for x in losses]
    out = []
    for loss in losses:  # each rank saw half the rows: the mean over ranks is the whole batch's loss
        loss = loss.clone()
        dist.all_reduce(loss)
        out.append(float(loss) / 2)
    return out


class _Stage(nn.Module):
    """A pipeline stage module: some of ``Stack``'s submodules, under their original names."""

    def __init__(self, full, names):
        super().__init__()
        for name in names:
            if name.startswith("layers."):
                if not hasattr(self, "layers"):
                    self.layers = nn.ModuleDict()
                self.layers[name.split(".")[1]] = full.get_submodule(name)
            else:
                setattr(self, name, full.get_submodule(name))


class _FakePipeline(nn.Module):
    """What a pipeline rank holds: ``stage_modules``, one or more stages of ``Stack``."""

    def __init__(self, stages, seed):
        super().__init__()
        torch.manual_seed(seed)
        full = Stack(hidden=6, inner=10, layers=2)
        self.stage_modules = nn.ModuleList(_Stage(full, names) for names in stages)


def _stage_params(model):
    return {n: p for stage in model.stage_modules for n, p in stage.named_parameters()}


def _stage_state(model, opt):
    names = {p: n for n, p in _stage_params(model).items()}
    return {"params": {n: p.detach().clone() for n, p in _stage_params(model).items()},
            "optim": {names[p]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}}


def _gpt2_config():
    return gpt2_config(attn="eager", dropout=0.1, n_embd=32, n_layer=1, vocab_size=64, n_positions=32)


def _spawned(rank, world, root):
    import torch.distributed as dist

    from schedlang.models import shard_model

    batches = _batches()
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    out = {}
    # -- save under TP and under FSDP2 after two steps
    for kind in ("tp", "fsdp"):
        model, opt = _layout_model(kind, seed=0)
        losses = _train(model, opt, batches[:2], rows if kind == "fsdp" else slice(None))
        out[f"{kind}_first"] = _global_losses(losses, kind)
        schedlang.save_checkpoint(os.path.join(root, kind), model, opt, step=2, extra={"layout": kind})
        out[f"{kind}_saved_params"] = _full_params(model)  # gathering is collective: every rank takes part
        out[f"{kind}_saved_optim"] = _full_optim(model, opt)
    # -- load each into the other layout (other initial weights) and continue
    for kind, source in (("fsdp", "tp"), ("tp", "fsdp")):
        model, opt = _layout_model(kind, seed=1)
        info = schedlang.load_checkpoint(os.path.join(root, source), model, opt)
        losses = _train(model, opt, batches[2:], rows if kind == "fsdp" else slice(None))
        out[f"{kind}_from_{source}"] = {"info": info, "losses": _global_losses(losses, kind),
                                        "params": _full_params(model)}
        # export as it is now (every rank runs the whole probe batch: the logits are the model's)
        schedlang.export_hf(model, os.path.join(root, f"hf_{kind}"))
        with torch.no_grad():
            out[f"{kind}_logits"] = model(input_ids=_probe(), use_cache=False).logits
    # -- pipelines: rank 0 holds two stages (layers.0 and the head), rank 1 one (layers.1)
    model = _FakePipeline([["layers.0"], ["head"]] if rank == 0 else [["layers.1"]], seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    schedlang.save_checkpoint(os.path.join(root, "pp"), model, opt, step=1)
    schedlang.export_hf(model, os.path.join(root, "hf_pp"), config={"model_type": "stack"})
    out["pp_saved"] = _stage_state(model, opt)
    # ... and back under other stages: rank 0 holds layers.1 and the head in one stage, rank 1 layers.0
    model = _FakePipeline([["layers.1", "head"]] if rank == 0 else [["layers.0"]], seed=6)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    schedlang.load_checkpoint(os.path.join(root, "pp"), model, opt)
    out["pp_loaded"] = _stage_state(model, opt)
    # -- GPT-2 under TP with FusedAdamW: c_attn is sharded block-wise (q, k, v each split over the ranks)
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    sch = schedlang.create_schedule(GPT2LMHeadModel(_gpt2_config()),
                                    mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    shard_model(sch, gather_logits=True)
    model, opt = schedlang.build(sch, optimizer="adamw", lr=LR)  # schedlang's FusedAdamW
    assert type(opt).__name__ == "FusedAdamW"
    torch.manual_seed(0)
    original = GPT2LMHeadModel(_gpt2_config()).transformer.h[0].attn.c_attn.weight
    gathered_right = torch.equal(_full(model.transformer.h[0].attn.c_attn.weight), original)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    placement = type(model.transformer.h[0].attn.c_attn.weight.placements[0]).__name__
    schedlang.save_checkpoint(os.path.join(root, "gpt2_tp"), model, opt, step=1)
    out["gpt2"] = {"placement": placement, "gathered_right": gathered_right, "params": _full_params(model), "optim": _full_optim(model, opt)}
    dist.barrier()
    # tensors sent through the result queue would be shared memory of a process about to exit: a file instead
    torch.save(out, os.path.join(root, f"rank{rank}.pt"))
    return os.path.join(root, f"rank{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    files = run_distributed(_spawned, world_size=2, args=(root,), timeout=240)
    return root, [torch.load(f, weights_only=True) for f in files]


@pytest.fixture(scope="module")
def reference():
    """One process trains four steps on the whole batch, never saving."""
    model = _llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches()
    first = _train(model, opt, batches[:2])
    saved_params, saved_optim = _full_params(model), _full_optim(model, opt)
    rest = _train(model, opt, batches[2:])
    return {"losses": [float(x) for x in first + rest], "saved_params": saved_params,
            "saved_optim": saved_optim, "params": _full_params(model), "model": model}


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _params_near(got, want, steps):
    """Parameters after ``steps`` AdamW steps under another layout match those of one process.

    Adam divides by the gradient's root mean square, so a near-zero gradient summed in another order
    can move its weight by a visible fraction of a step: the bound is 1% of the farthest Adam can move
    a weight (lr x steps). Wrong or stale state moves weights by whole steps.
    """
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst < 0.01 * LR * steps, worst


def _close_dicts(got, want, tol=1e-5):
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], dict):
            _close_dicts(got[key], want[key], tol)
        else:
            _close(got[key].float(), want[key].float(), tol)


# ---------------------------------------------------------------------------------------------- one process
def _mlp_train(model, opt, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(i))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("optimizer", ["AdamW", "FusedAdamW"])
def test_one_process_round_trip_resumes_exactly(tmp_path, optimizer):
    import schedlang.optim

    make = getattr(torch.optim, optimizer, None) or getattr(schedlang.optim, optimizer)
    torch.manual_seed(0)
    model = MLP(hidden=7, inner=13)
    opt = make(model.parameters(), lr=LR, weight_decay=0.1)
    _mlp_train(model, opt, 2)
    schedlang.save_checkpoint(tmp_path / "c", model, opt, step=2, extra={"sched": {"last_epoch": 2}})
    expected = _mlp_train(model, opt, 2, start=2)

    torch.manual_seed(1)
    model2 = MLP(hidden=7, inner=13)
    opt2 = make(model2.parameters(), lr=0.5)  # hyperparameters come from the checkpoint too
    info = schedlang.load_checkpoint(tmp_path / "c", model2, opt2)
    assert info == {"step": 2, "extra": {"sched": {"last_epoch": 2}}}
    assert opt2.param_groups[0]["lr"] == LR and opt2.param_groups[0]["weight_decay"] == 0.1
    got = _mlp_train(model2, opt2, 2, start=2)
    assert [float(x) for x in got] == [float(x) for x in expected]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_saving_before_the_first_step_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model, fresh = MLP(hidden=7, inner=13), MLP(hidden=7, inner=13)
    fresh.load_state_dict(model.state_dict())
    opt, fresh_opt = torch.optim.AdamW(model.parameters(), lr=LR), torch.optim.AdamW(fresh.parameters(), lr=LR)
    schedlang.save_checkpoint(tmp_path / "c", model, opt)
    assert not opt.state  # torch created state to save; it is dropped again
    expected = _mlp_train(fresh, fresh_opt, 2)
    assert [float(x) for x in _mlp_train(model, opt, 2)] == [float(x) for x in expected]
    torch.manual_seed(3)
    other = MLP(hidden=7, inner=13)
    other_opt = torch.optim.AdamW(other.parameters(), lr=LR)
    assert schedlang.load_checkpoint(tmp_path / "c", other, other_opt) == {"step": None, "extra": None}
    assert [float(x) for x in _mlp_train(other, other_opt, 2)] == [float(x) for x in expected]


def test_parameters_without_state_stay_without(tmp_path):
    class WithUnused(MLP):
        def __init__(self):
            super().__init__(hidden=7, inner=13)
            self.unused = nn.Linear(3, 3)  # never gets a gradient: AdamW keeps no state for it

    torch.manual_seed(0)
    model = WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _mlp_train(model, opt, 2)
    schedlang.save_checkpoint(tmp_path / "c", model, opt, step=2)
    expected = _mlp_train(model, opt, 2, start=2)
    model2 = WithUnused()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=LR)
    schedlang.load_checkpoint(tmp_path / "c", model2, opt2)
    assert model2.unused.weight not in opt2.state and len(opt2.state) == 4
    assert [float(x) for x in _mlp_train(model2, opt2, 2, start=2)] == [float(x) for x in expected]


def test_torch_adamw_state_loads_into_fused_adamw_with_its_lr_tensor(tmp_path):
    from schedlang.optim import FusedAdamW

    torch.manual_seed(0)
    model = MLP(hidden=7, inner=13)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _mlp_train(model, opt, 2)
    schedlang.save_checkpoint(tmp_path / "c", model, opt, step=2)
    expected = _full_optim(model, opt)
    model2 = MLP(hidden=7, inner=13)
    lr = torch.tensor(0.5)
    opt2 = FusedAdamW(model2.parameters(), lr=lr)
    schedlang.load_checkpoint(tmp_path / "c", model2, opt2)
    assert opt2.param_groups[0]["lr"] is lr  # the same tensor, holding the saved value
    assert float(lr) == pytest.approx(LR)
    got = _full_optim(model2, opt2)
    for name in expected:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][key], expected[name][key])
        assert float(got[name]["step"]) == float(expected[name]["step"])


# ---------------------------------------------------------------------------------------------- across layouts
def test_layouts_train_like_one_process_before_saving(spawned, reference):
    _, results = spawned
    for r in results:
        _close(torch.tensor(r["tp_first"]), torch.tensor(reference["losses"][:2]))
        _close(torch.tensor(r["fsdp_first"]), torch.tensor(reference["losses"][:2]))
    _params_near(results[0]["tp_saved_params"], reference["saved_params"], steps=2)
    _params_near(results[0]["fsdp_saved_params"], reference["saved_params"], steps=2)


@pytest.mark.parametrize("kind,source", [("fsdp", "tp"), ("tp", "fsdp")])
def test_checkpoint_of_one_layout_resumes_under_another(spawned, reference, kind, source):
    _, results = spawned
    for r in results:
        entry = r[f"{kind}_from_{source}"]
        assert entry["info"] == {"step": 2, "extra": {"layout": source}}
        _close(torch.tensor(entry["losses"]), torch.tensor(reference["losses"][2:]))
    _params_near(results[0][f"{kind}_from_{source}"]["params"], reference["params"], steps=4)


def test_tensor_parallel_checkpoint_loads_in_one_process(spawned, reference):
    root, results = spawned
    model = _llama(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert schedlang.load_checkpoint(os.path.join(root, "tp"), model, opt)["step"] == 2
    # exactly what the ranks held (gathered), and what one process reaches in the same two steps
    for name, p in model.named_parameters():
        assert torch.equal(p, results[0]["tp_saved_params"][name]), name
    got = _full_optim(model, opt)
    for name, state in results[0]["tp_saved_optim"].items():
        for key, value in state.items():
            assert torch.equal(got[name][key].float(), value.float()), (name, key)
    _close_dicts(got, reference["saved_optim"])
    losses = _train(model, opt, _batches()[2:])
    _close(torch.tensor([float(x) for x in losses]), torch.tensor(reference["losses"][2:]))


def _union(results, key):
    out = {"params": {}, "optim": {}}
    for r in results:
        for part in out:
            out[part].update(r[key][part])
    return out


def test_pipeline_checkpoint_loads_in_one_process_and_under_other_stages(spawned):
    from safetensors.torch import load_file

    root, results = spawned
    saved = _union(results, "pp_saved")
    torch.manual_seed(9)
    model = Stack(hidden=6, inner=10, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert schedlang.load_checkpoint(os.path.join(root, "pp"), model, opt)["step"] == 1
    assert sorted(saved["params"]) == sorted(n for n, _ in model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, saved["params"][name]), name
    got = _full_optim(model, opt)
    for name, state in saved["optim"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[name][key], state[key]), (name, key)
    loaded = _union(results, "pp_loaded")  # other stages on the ranks
    for part in ("params", "optim"):
        _close_dicts(loaded[part], saved[part], tol=0)
    exported = load_file(os.path.join(root, "hf_pp", "model.safetensors"))
    _close_dicts(exported, saved["params"], tol=0)  # rank 1's stage reached rank 0
    assert json.loads(open(os.path.join(root, "hf_pp", "config.json")).read())["model_type"] == "stack"


def test_blockwise_sharded_qkv_loads_in_one_process(spawned):
    from transformers import GPT2LMHeadModel

    root, results = spawned
    saved = results[0]["gpt2"]
    assert saved["placement"] == "_StridedShard"
    assert saved["gathered_right"]  # the gathered q|k|v weight is the unsharded model's
    torch.manual_seed(1)
    model = GPT2LMHeadModel(_gpt2_config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    schedlang.load_checkpoint(os.path.join(root, "gpt2_tp"), model, opt)
    for name, p in model.named_parameters():
        assert torch.equal(p, saved["params"][name]), name
    got = _full_optim(model, opt)
    for name, state in saved["optim"].items():
        assert torch.equal(got[name]["exp_avg"], state["exp_avg"]), name


def _spawned_2d(rank, world, root):
    """FSDP2 over tensor parallelism (2 x 2 ranks), tied embeddings: save, export, load back."""
    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model

    def build(seed):
        sch = schedlang.create_schedule(_llama(seed, tie=True), mesh=make_mesh(dp=2, tp=2, device_type="cpu"))
        shard_model(sch, gather_logits=True)
        for i in range(2):
            sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
        return schedlang.build(sch, optimizer=torch.optim.AdamW, lr=LR)

    model, opt = build(0)
    dp_rank = rank // 2  # make_mesh puts tp innermost
    _train(model, opt, _batches()[:2], rows=slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2))
    schedlang.save_checkpoint(os.path.join(root, "c"), model, opt, step=2)
    schedlang.export_hf(model, os.path.join(root, "hf"))
    saved = {"params": _full_params(model), "optim": _full_optim(model, opt),
             "placements": [type(x).__name__ for x in model.model.layers[0].mlp.up_proj.weight.placements]}
    model, opt = build(1)
    schedlang.load_checkpoint(os.path.join(root, "c"), model, opt)
    saved["reloaded"] = {"params": _full_params(model), "optim": _full_optim(model, opt)}
    torch.save(saved, os.path.join(root, f"rank{rank}.pt"))
    return os.path.join(root, f"rank{rank}.pt")


def test_fsdp2_over_tensor_parallel_checkpoint_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    files = run_distributed(_spawned_2d, world_size=4, args=(str(tmp_path),), timeout=240)
    saved = torch.load(files[0], weights_only=True)
    assert saved["placements"] == ["_StridedShard", "Shard"]  # dp shards the tp shard again
    _close_dicts(saved["reloaded"]["params"], saved["params"], tol=0)
    _close_dicts(saved["reloaded"]["optim"], saved["optim"], tol=0)
    model = _llama(seed=3, tie=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    schedlang.load_checkpoint(tmp_path / "c", model, opt)
    _close_dicts(_full_params(model), saved["params"], tol=0)
    _close_dicts(_full_optim(model, opt), saved["optim"], tol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    _close_dicts(_full_params(hf), saved["params"], tol=0)


# ---------------------------------------------------------------------------------------------- HF export
@pytest.mark.parametrize("kind", ["tp", "fsdp"])
def test_export_from_sharded_layouts_loads_with_from_pretrained(spawned, kind):
    from transformers import AutoModelForCausalLM

    root, results = spawned
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, f"hf_{kind}"))
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        logits = hf(input_ids=_probe(), use_cache=False).logits
    _close(logits, results[0][f"{kind}_logits"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_from_one_process_with_tied_embeddings(tmp_path, dtype):
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    model = _llama(seed=2, tie=True).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, _batches(1))
    schedlang.export_hf(model, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == dtype
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    for name, p in model.named_parameters():
        assert torch.equal(hf.get_parameter(name), p), name
    # .to(bfloat16) also rounds the rotary inv_freq buffer, which from_pretrained computes in fp32
    tol = 0 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=_probe()).logits, model(input_ids=_probe()).logits,
                                   rtol=tol, atol=tol)


def test_export_unties_embeddings_that_training_untied(tmp_path):
    from transformers import LlamaForCausalLM

    model = _llama(seed=2, tie=False)  # separate tensors, but the exported config will claim a tie
    config = _llama_config(tie=True)
    schedlang.export_hf(model, tmp_path / "hf", config=config)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    assert config.tie_word_embeddings is True  # the caller's config is not changed
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=_probe()).logits, model(input_ids=_probe()).logits)


# ---------------------------------------------------------------------------------------------- errors
def _saved_mlp(path, **kw):
    torch.manual_seed(0)
    model = MLP(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    schedlang.save_checkpoint(path, model, opt, step=1)  # no step taken: the state is saved as zeros
    return model


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(schedlang.CheckpointError, match=r"no checkpoint directory at '.*nowhere'"):
        schedlang.load_checkpoint(tmp_path / "nowhere", MLP())
    (tmp_path / "half").mkdir()
    with pytest.raises(schedlang.CheckpointError, match=r"'.*half' is not a complete checkpoint: its \.metadata "
                                                        r"file is missing"):
        schedlang.load_checkpoint(tmp_path / "half", MLP())


def test_names_of_unexpected_and_missing_tensors(tmp_path):
    from tests.helpers.models import Block

    _saved_mlp(tmp_path / "mlp", hidden=12, inner=20)
    with pytest.raises(schedlang.CheckpointError) as e:
        schedlang.load_checkpoint(tmp_path / "mlp", Block(hidden=12, inner=20))
    msg = str(e.value)
    assert "does not fit the model" in msg
    assert "4 tensor(s) in the checkpoint are not in the model: 'fc1.bias', 'fc1.weight', 'fc2.bias', 'fc2.weight'" in msg
    assert ("6 model tensor(s) of the model are missing from the checkpoint: 'mlp.fc1.bias', 'mlp.fc1.weight', "
            "'mlp.fc2.bias', 'mlp.fc2.weight', 'norm.bias', 'norm.weight'") in msg
    assert isinstance(e.value, ValueError)


def test_shape_mismatch_names_tensor_and_shapes_and_loads_nothing(tmp_path):
    _saved_mlp(tmp_path / "c", hidden=12, inner=20)
    torch.manual_seed(1)
    model = MLP(hidden=12, inner=24)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(schedlang.CheckpointError) as e:
        schedlang.load_checkpoint(tmp_path / "c", model, opt)
    msg = str(e.value)
    assert "shape mismatch for model 'fc1.weight': checkpoint (20, 12), model (24, 12)" in msg
    assert "shape mismatch for optimizer state 'state.fc1.weight.exp_avg': checkpoint (20, 12), model (24, 12)" in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # fc2.bias fits, yet untouched
    assert not opt.state


def test_a_checkpoint_of_another_size_names_a_few_mismatches_and_counts_the_rest(tmp_path):
    """Every tensor of a wider model mismatches: the error shows the first few and how many more, not them all."""
    torch.manual_seed(0)
    wide = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    schedlang.save_checkpoint(tmp_path / "c", wide)
    narrow = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    with pytest.raises(schedlang.CheckpointError) as e:
        schedlang.load_checkpoint(tmp_path / "c", narrow)
    lines = str(e.value).splitlines()
    assert lines[1] == "  shape mismatch for model '0.weight': checkpoint (8, 8), model (4, 4)"
    assert lines[-1] == "  ... and 16 more model shape mismatches"  # 24 tensors, 8 named
    assert len(lines) == 10


def test_checkpoint_without_optimizer_state(tmp_path):
    model = MLP()
    schedlang.save_checkpoint(tmp_path / "c", model)
    assert schedlang.load_checkpoint(tmp_path / "c", MLP()) == {"step": None, "extra": None}
    with pytest.raises(schedlang.CheckpointError, match="holds no optimizer state .saved without an optimizer.; "
                                                        "pass optimizer=None to load the model only"):
        schedlang.load_checkpoint(tmp_path / "c", model, torch.optim.AdamW(model.parameters()))


def test_directory_not_written_by_save_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it runs in one process
        dcp.save({"fc1.weight": torch.zeros(2, 2)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    with pytest.raises(schedlang.CheckpointError, match=r"'.*c' was not written by save_checkpoint \(it has no "
                                                        r"'schedlang' record\)"):
        schedlang.load_checkpoint(tmp_path / "c", MLP())


def test_extra_must_be_plain_values(tmp_path):
    import pathlib

    with pytest.raises(schedlang.CheckpointError, match=r"extra must hold plain Python values .*PosixPath"):
        schedlang.save_checkpoint(tmp_path / "c", MLP(), extra={"where": pathlib.PosixPath("/tmp")})


def _data_items(path):
    """``(data file, offset)`` of every entry of a checkpoint, by fully qualified name, as its .metadata places them."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {index.fqn: (os.path.join(str(path), info.relative_path), info.offset)
            for index, info in md.storage_data.items()}


def _corrupt(path, fqn):
    """Overwrite the start of ``fqn``'s entry (the zip header of its pickled tensor): the file keeps its size."""
    file, offset = _data_items(path)[fqn]
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 16)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_data_file_is_named_and_nothing_is_loaded(tmp_path, damage):
    _saved_mlp(tmp_path / "c")
    (data_file,) = {file for file, _ in _data_items(tmp_path / "c").values()}
    if damage == "missing":
        os.remove(data_file)
    else:
        os.truncate(data_file, os.path.getsize(data_file) // 2)
    torch.manual_seed(1)
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(schedlang.CheckpointError) as e:
        schedlang.load_checkpoint(tmp_path / "c", model)
    what = "is missing" if damage == "missing" else r"is truncated \(\d+ bytes; the \.metadata places data up to byte \d+\)"
    assert re.match(rf"^load_checkpoint: '.*c' is not a complete checkpoint: .*__0_0\.distcp {what}; check that every "
                    r"file of the checkpoint was written and copied whole", str(e.value)), str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_read_that_fails_midway_leaves_the_model_and_the_optimizer_unchanged(tmp_path):
    """The last entry DCP reads is corrupt (the file keeps its size): every tensor before it was already read,
    into staging tensors, not into the model's parameters or the optimizer's state."""
    _saved_mlp(tmp_path / "c")
    items = _data_items(tmp_path / "c")
    _corrupt(tmp_path / "c", max(items, key=lambda fqn: items[fqn][1]))
    torch.manual_seed(1)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(schedlang.CheckpointError, match=r"^load_checkpoint: cannot read '.*c': rank 0: \w+: .*; "
                                                        r"check that every file of the checkpoint was written and "
                                                        r"copied whole, or load an earlier checkpoint; the model and "
                                                        r"optimizer are unchanged$"):
        schedlang.load_checkpoint(tmp_path / "c", model, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state  # the state torch made to read into is dropped again


def _spawned_corrupt_shard(rank, world, root):
    """Two tensor-parallel ranks; the shard only rank 1 reads is corrupt: both ranks raise, neither waits."""
    from torch.distributed.device_mesh import init_device_mesh

    def built(seed):
        torch.manual_seed(seed)
        sch = schedlang.create_schedule(MLP(), mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].shard("bias", axis=0)
        sch["fc2"].shard("weight", axis=1)
        sch["fc2"].sync("fwd_post", "all_reduce")
        return schedlang.build(sch)[0]

    schedlang.save_checkpoint(root, built(0))
    if rank == 0:
        # rank 1's rows of fc1.weight: the entry in the data file rank 1 wrote
        file, offset = max((v for k, v in _data_items(root).items() if k == "model.fc1.weight"
                            and v[0].endswith("__1_0.distcp")), key=lambda v: v[1])
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(b"\0" * 16)
    torch.distributed.barrier()
    model = built(1)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    try:
        schedlang.load_checkpoint(root, model)
        error = None
    except schedlang.CheckpointError as e:
        error = str(e)
    unchanged = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    return error, unchanged


def test_a_failed_read_on_one_rank_raises_on_every_rank_and_changes_no_model(tmp_path):
    results = run_distributed(_spawned_corrupt_shard, world_size=2, args=(str(tmp_path / "c"),), timeout=120)
    for error, unchanged in results:
        assert error is not None and error.startswith(f"load_checkpoint: cannot read '{tmp_path / 'c'}': rank 1: ")
        assert "the model and optimizer are unchanged" in error and unchanged


@pytest.mark.parametrize("arguments, message", [
    (dict(extra={"callback": lambda: 1}), r"save_checkpoint: extra must hold plain Python values \(dict, list, tuple, "
                                          r"str, int, float, bool, None\) and tensors; \w+Error: .*lambda"),
    (dict(model=5), r"save_checkpoint: model must be a torch\.nn\.Module \(the model schedlang\.build returns\), "
                    r"got int 5$"),
    (dict(model="schedule"), r"save_checkpoint: model must be a torch\.nn\.Module .*got Schedule .*; build the "
                             r"schedule first: model, opt = schedlang\.build\(sch\)$"),
    (dict(optimizer=5), r"save_checkpoint: optimizer must be a torch\.optim\.Optimizer over the model's parameters, "
                        r"or None for the model alone, got int 5$"),
    (dict(path=5), r"save_checkpoint: path must be a directory path \(a str or os\.PathLike\), got int 5$"),
])
def test_save_checkpoint_refuses_bad_arguments_before_writing_anything(tmp_path, arguments, message):
    call = {"path": tmp_path / "c", "model": MLP(), **arguments}
    if call["model"] == "schedule":
        call["model"] = schedlang.create_schedule(MLP())
    with pytest.raises(schedlang.CheckpointError, match="^" + message):
        schedlang.save_checkpoint(**call)
    assert not (tmp_path / "c").exists()


def test_load_checkpoint_refuses_what_is_not_a_model_or_a_path(tmp_path):
    schedlang.save_checkpoint(tmp_path / "c", MLP())
    with pytest.raises(schedlang.CheckpointError, match=r"^load_checkpoint: model must be a torch\.nn\.Module"):
        schedlang.load_checkpoint(tmp_path / "c", schedlang.create_schedule(MLP()))
    with pytest.raises(schedlang.CheckpointError, match=r"^load_checkpoint: path must be a directory path"):
        schedlang.load_checkpoint(None, MLP())
    with pytest.raises(schedlang.CheckpointError, match=r"^load_checkpoint: optimizer must be a torch\.optim"):
        schedlang.load_checkpoint(tmp_path / "c", MLP(), optimizer=[])


def test_export_without_config(tmp_path):
    with pytest.raises(schedlang.CheckpointError, match=r"export_hf: MLP has no \.config; pass config= "):
        schedlang.export_hf(MLP(), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_refuses_names_the_hf_class_does_not_have(tmp_path):
    model = _llama(seed=2)
    model.model.layers[1].mlp.up_proj.weight = nn.Parameter(torch.zeros(128, 60))
    with pytest.raises(schedlang.CheckpointError) as e:
        schedlang.export_hf(MLP(), tmp_path / "a", config=_llama_config())
    assert str(e.value).startswith("export_hf: the model does not fit LlamaForCausalLM; nothing written:\n  "
                                   "21 tensor(s) that LlamaForCausalLM expects are not in the model: "
                                   "'lm_head.weight', 'model.embed_tokens.weight', ")
    with pytest.raises(schedlang.CheckpointError, match=r"shape mismatch for 'model.layers.1.mlp.up_proj.weight': "
                                                        r"model \(128, 60\), LlamaForCausalLM \(128, 64\)"):
        schedlang.export_hf(model, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()



def test_master_weights_round_trip_resumes_exactly(tmp_path):
    """bf16 Linear weights with fp32 masters: the checkpoint keeps the masters (optimizer state), and loading
    refreshes every bf16 weight from its master, so the resumed run continues bit for bit."""
    import schedlang.optim

    def make(seed):
        torch.manual_seed(seed)
        model = MLP(hidden=7, inner=13)
        return model, schedlang.optim.FusedAdamW(schedlang.optim.master_weight_groups(model), lr=LR,
                                                 weight_decay=0.1)

    def train(model, opt, steps, start):
        losses = []
        for i in range(start, start + steps):
            x = torch.randn(5, 7, generator=torch.Generator().manual_seed(i))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        return losses

    model, opt = make(0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    train(model, opt, 2, 0)
    schedlang.save_checkpoint(tmp_path / "c", model, opt, step=2)
    expected = train(model, opt, 2, 2)
    model2, opt2 = make(1)
    schedlang.load_checkpoint(tmp_path / "c", model2, opt2)
    assert train(model2, opt2, 2, 2) == expected
    for p, q in zip(model.parameters(), model2.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
    for p, q in zip(opt.masters().values(), opt2.masters().values()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------------- plain local shards
def _plain_shards_of_rank_0_of_2():
    """An MLP a schedule split as rank 0 of 2 (the group faked), built in this one process: without a mesh its
    shards stay plain tensors. The export of a model built over two ranks is in tests/test_pretrained.py."""
    from unittest import mock

    import schedlang.distributed.groups as groups

    with mock.patch.object(groups, "world_size", lambda group=None: 2), \
            mock.patch.object(groups, "rank", lambda group=None: 0):
        sch = schedlang.create_schedule(MLP())
        sch["fc1"].shard("weight", axis=0)
        sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["fc2"].shard("weight", axis=1)
        sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        model, _ = schedlang.build(sch)
    return model


def test_export_of_plain_shards_needs_the_ranks_they_were_split_over(tmp_path):
    model = _plain_shards_of_rank_0_of_2()
    assert tuple(model.fc1.weight.shape) == (10, 12)
    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.export_hf(model, tmp_path / "hf", config={"model_type": "mlp"})
    assert str(info.value) == (
        "export_hf: 'fc1.weight' is a plain local shard of rank 0 of 2, but this process is rank 0 of 1 of the "
        "process group the model syncs over; call it on the ranks the schedule was built on")
    assert not (tmp_path / "hf").exists()


def test_export_of_plain_shards_refuses_sync_points_on_several_groups(tmp_path):
    from schedlang.distributed.sync_ops import SyncOp

    model = _plain_shards_of_rank_0_of_2()
    syncs = [m for m in model.modules() if isinstance(m, SyncOp)]
    assert len(syncs) == 2
    for sync in syncs:
        sync.group = object()  # stands for two distinct process groups
    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.export_hf(model, tmp_path / "hf", config={"model_type": "mlp"})
    assert str(info.value) == (
        "export_hf: the model's sync points run on 2 different process groups, so which one its plain local shards "
        "are split over is unknown; build the schedule with a mesh "
        "(schedlang.create_schedule(model, mesh=make_mesh(tp=...)))")


def test_plain_shards_are_refused_by_save_and_load_before_anything_is_written(tmp_path):
    """A DCP checkpoint records a global layout that plain shards do not carry: both directions refuse."""
    model = _plain_shards_of_rank_0_of_2()
    expected = ("'fc1.weight' is a plain local shard (rank 0 of 2, of (20, 12)): the schedule was made without a "
                "mesh, so build kept its shards plain tensors, whose layout a checkpoint cannot record; create the "
                "schedule with a mesh (schedlang.create_schedule(model, mesh=make_mesh(tp=...))) to checkpoint it")
    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.save_checkpoint(tmp_path / "ckpt", model)
    assert str(info.value) == "save_checkpoint: " + expected
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.partial").exists()
    schedlang.save_checkpoint(tmp_path / "whole", MLP())  # a checkpoint of the unsharded MLP, to load from
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.load_checkpoint(tmp_path / "whole", model)
    assert str(info.value) == "load_checkpoint: " + expected
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
