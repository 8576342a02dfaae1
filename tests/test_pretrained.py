"""Pretrained weights from HF safetensors: ``build(sch, pretrained=DIR)`` and ``load_pretrained``.

A tiny LLaMA (tied embeddings, grouped key/value heads, saved as several files with an index) and a
tiny GPT-2 (Conv1D weights, fused q|k|v) are saved by ``save_pretrained``; one spawned run on two
gloo ranks builds each under TP=2, FSDP2=2 and PP=2 from the files and compares the loss with
``from_pretrained``'s, while a wrapped ``safe_open`` records every slice a rank asks for. The same
run exports the tensor-parallel LLaMA and loads it back under FSDP2. Another run builds LLaMA, GPT-2
and Phi-3 (q|k|v of unequal widths) from a schedule without a mesh, whose shards stay plain local
tensors, and checks ``load_pretrained`` and ``export_hf`` of them.
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch
import torch.nn.functional as F

import schedlang
from schedlang.distributed.launch import run_distributed
from tests.helpers.hf_models import gpt2_config, llama_config

BATCH, SEQ = 4, 9


def _llama_config(**kw):
    return llama_config(**{**dict(hidden_size=48, num_key_value_heads=2, intermediate_size=80, vocab_size=96,
                                  max_position_embeddings=64, tie_word_embeddings=True), **kw})


def _gpt2_config(**kw):
    return gpt2_config(attn="eager", **{**dict(n_embd=32, n_inner=72, vocab_size=64, n_positions=32), **kw})


FAMILIES = {"llama": (_llama_config, "model.layers.0"), "gpt2": (_gpt2_config, "transformer.h.0")}


def _model_class(family):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return LlamaForCausalLM if family == "llama" else GPT2LMHeadModel


def _tokens(vocab):
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(11))


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def _save(family, directory, seed=0, dtype=None, **save_kw):
    torch.manual_seed(seed)
    model = _model_class(family)(FAMILIES[family][0]())
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory, **save_kw)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The two checkpoints and the loss ``from_pretrained`` gives on the fixed batch."""
    root = str(tmp_path_factory.mktemp("pretrained"))
    out = {"root": root}
    for family in FAMILIES:
        directory = os.path.join(root, family)
        # the LLaMA is split into several files with an index, the GPT-2 is one file
        _save(family, directory, **({"max_shard_size": "40KB"} if family == "llama" else {}))
        hf = _model_class(family).from_pretrained(directory)
        tokens = _tokens(hf.config.vocab_size)
        with torch.no_grad():
            out[family] = float(_loss(hf(input_ids=tokens[:, :-1]).logits, tokens[:, 1:]))
    assert len([f for f in os.listdir(os.path.join(root, "llama")) if f.endswith(".safetensors")]) > 2
    return out


# ---------------------------------------------------------------------------------------------- the spawned run
class _RecordingSlice:
    def __init__(self, inner, name, log):
        self.inner, self.name, self.log = inner, name, log

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        piece = self.inner[index]
        self.log.append((self.name, piece.numel(), "slice"))
        return piece


class _RecordingHandle:
    """``safe_open`` that logs every tensor read: (name, elements, how)."""

    original = None
    log: list = []

    def __init__(self, path, framework="pt", **kw):
        self.inner = type(self).original(path, framework=framework, **kw)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return _RecordingSlice(self.inner.get_slice(name), name, self.log)

    def get_tensor(self, name):
        t = self.inner.get_tensor(name)
        self.log.append((name, t.numel(), "whole"))
        return t


def _local_tensors(model):
    """This rank's distinct tensors of the built model (the pieces it should read), a tied tensor once: torch's
    state dict detaches every value, so tensors are told apart by their memory."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from schedlang.distributed.dtensor_params import local_tensor

    out = {}
    for stage in getattr(model, "stage_modules", [model]):
        for value in get_model_state_dict(stage).values():
            local = local_tensor(value)
            out.setdefault((local.data_ptr(), tuple(local.shape)), local)
    return list(out.values())


def _schedule(family, layout, cfg=None):
    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model

    cfg = cfg or FAMILIES[family][0]()
    with schedlang.init_empty_weights():
        model = _model_class(family)(cfg)
    sizes = {"tp": dict(tp=2), "fsdp": dict(dp=2), "pp": dict(pp=2)}[layout]
    sch = schedlang.create_schedule(model, mesh=make_mesh(device_type="cpu", **sizes))
    pipeline = None
    if layout == "tp":
        shard_model(sch, gather_logits=True)
    elif layout == "fsdp":
        layers = "model.layers" if family == "llama" else "transformer.h"
        for i in range(cfg.num_hidden_layers):
            sch[f"{layers}.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
    else:
        sch[FAMILIES[family][1]].cut_pipeline_stage()
        pipeline = {"schedule": "1F1B", "n_microbatches": 2, "loss_fn": _loss}
    return sch, pipeline


def _loss_of(model, tokens):
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    if hasattr(model, "stage_modules"):
        losses = []
        model.step(ids, target=labels, losses=losses)  # a training step's forward (torch's schedules need grad)
        return float(torch.stack(losses).mean().detach()) if losses else None
    with torch.no_grad():
        return float(_loss(model(input_ids=ids, use_cache=False).logits, labels))


def _spawned(rank, world, root):
    import safetensors
    from safetensors.torch import load_file

    from schedlang.checkpoint import full_tensor
    from schedlang.distributed.dtensor_params import is_dtensor

    _RecordingHandle.original = safetensors.safe_open
    safetensors.safe_open = _RecordingHandle
    out = {}
    for family in FAMILIES:
        directory = os.path.join(root, family)
        stored = {}
        for f in sorted(os.listdir(directory)):
            if f.endswith(".safetensors"):
                stored.update(load_file(os.path.join(directory, f)))
        for layout in ("tp", "fsdp", "pp"):
            sch, pipeline = _schedule(family, layout)
            _RecordingHandle.log.clear()
            model, _ = schedlang.build(sch, pretrained=directory, pipeline=pipeline)
            reads = list(_RecordingHandle.log)
            pieces = _local_tensors(model)
            entry = {"loss": _loss_of(model, _tokens(FAMILIES[family][0]().vocab_size)),
                     "read": sum(n for _, n, _ in reads), "local": sum(p.numel() for p in pieces),
                     "largest_read": max(n for _, n, _ in reads), "largest_local": max(p.numel() for p in pieces),
                     "whole_reads": [name for name, _, how in reads if how == "whole"],
                     "stored": sum(t.numel() for t in stored.values())}
            if layout != "pp":  # every parameter gathered equals the stored tensor (or its tied partner's)
                wrong = []
                for name, p in model.named_parameters():
                    key = name if name in stored else ("model.embed_tokens.weight" if family == "llama"
                                                       else "transformer.wte.weight")
                    if not torch.equal(full_tensor(p.detach()), stored[key]):
                        wrong.append(name)
                entry["wrong"] = wrong
                entry["dtensors"] = sum(is_dtensor(p) for p in model.parameters())
            out[f"{family}_{layout}"] = entry
    # the regions of DTensors that torch itself laid out, on uneven shapes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from schedlang.pretrained import local_regions

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(7 * 18, dtype=torch.float32).reshape(7, 18)
    regions_right = []
    for placements in ([Shard(0)], [Shard(1)], [_StridedShard(1, split_factor=3)], [_StridedShard(0, split_factor=2)]):
        # the shard torch's own placement cuts for this rank (distribute_tensor refuses _StridedShard)
        local = placements[0]._split_tensor(full, 2, with_padding=False)[0][rank].contiguous()
        dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
        regions = local_regions(dt)
        regions_right.append(sum(local[li].numel() for li, _ in regions) == local.numel()
                             and all(torch.equal(local[li], full[gi]) for li, gi in regions))
    out["regions_right"] = regions_right
    # a checkpoint that does not fit: every rank raises the same error, nothing is allocated
    sch, _ = _schedule("llama", "tp", _llama_config(intermediate_size=64))
    try:
        schedlang.build(sch, pretrained=os.path.join(root, "llama"))
        out["mismatch"] = None
    except schedlang.CheckpointError as e:
        out["mismatch"] = str(e)
    out["mismatch_still_meta"] = all(p.is_meta for p in sch.mod.parameters())
    # export under TP, load under FSDP2 into a randomly initialized model: the same logits
    safetensors.safe_open = _RecordingHandle.original
    sch, _ = _schedule("llama", "tp")
    tp_model, _ = schedlang.build(sch, pretrained=os.path.join(root, "llama"))
    ids = _tokens(96)[:, :-1]
    with torch.no_grad():
        tp_logits = tp_model(input_ids=ids, use_cache=False).logits
    schedlang.export_hf(tp_model, os.path.join(root, "exported"))
    sch, _ = _schedule("llama", "fsdp")
    torch.manual_seed(5)
    fsdp_model, _ = schedlang.build(sch)
    info = schedlang.load_pretrained(fsdp_model, os.path.join(root, "exported"))
    with torch.no_grad():
        fsdp_logits = fsdp_model(input_ids=ids, use_cache=False).logits
    out["round_trip"] = {"max_diff": float((tp_logits - fsdp_logits).abs().max()), "tensors": info["tensors"]}
    return out


def _spawned_2d(rank, world, root):
    """dp=2 x tp=2: FSDP2 shards the tensor-parallel shards again (strided on both mesh dimensions)."""
    from schedlang.checkpoint import full_tensor
    from schedlang.checkpoint.state import _gather_by_hand, _strided
    from schedlang.distributed.mesh import make_mesh
    from schedlang.models import shard_model

    out = {}
    for family, layers in (("llama", "model.layers"), ("gpt2", "transformer.h")):
        with schedlang.init_empty_weights():
            model = _model_class(family)(FAMILIES[family][0]())
        sch = schedlang.create_schedule(model, mesh=make_mesh(dp=2, tp=2, device_type="cpu"))
        shard_model(sch, gather_logits=True)
        for i in range(2):
            sch[f"{layers}.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
        model, _ = schedlang.build(sch, pretrained=os.path.join(root, family))
        placements = {n: str(p.placements) for n, p in model.named_parameters()}
        # gathered, every parameter is the one transformers loads (tensors cannot cross the result queue)
        reference = _model_class(family).from_pretrained(os.path.join(root, family)).state_dict()
        wrong = [n for n, p in model.named_parameters() if not torch.equal(full_tensor(p.detach()), reference[n])]
        # the gather full_tensor does by hand where DTensor refuses FSDP2 over a fused q|k|v shard (torch 2.11)
        by_hand = {n: torch.equal(_gather_by_hand(p.detach()), reference[n])
                   for n, p in model.named_parameters() if _strided(p)}
        out[family] = {"loss": _loss_of(model, _tokens(FAMILIES[family][0]().vocab_size)), "placements": placements,
                       "wrong": wrong, "by_hand": by_hand}
    return out


@pytest.fixture(scope="module")
def spawned(saved):
    return run_distributed(_spawned, world_size=2, args=(saved["root"],), timeout=300)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", ["tp", "fsdp", "pp"])
def test_built_from_safetensors_gives_the_loss_of_from_pretrained(saved, spawned, family, layout):
    losses = [r[f"{family}_{layout}"]["loss"] for r in spawned]
    if layout == "pp":
        losses = [x for x in losses if x is not None]  # the last stage's rank computes it
        assert len(losses) == 1
    for loss in losses:
        assert loss == pytest.approx(saved[family], rel=1e-5, abs=1e-5)


def test_fsdp2_over_tensor_parallel_shards_on_four_ranks(saved):
    results = run_distributed(_spawned_2d, world_size=4, args=(saved["root"],), timeout=300)
    for family in FAMILIES:
        for r in results:
            assert r[family]["loss"] == pytest.approx(saved[family], rel=1e-5, abs=1e-5)
            assert r[family]["wrong"] == [], {n: r[family]["placements"][n] for n in r[family]["wrong"]}
    assert results[0]["gpt2"]["by_hand"] and all(results[0]["gpt2"]["by_hand"].values()), results[0]["gpt2"]["by_hand"]
    # the layouts this covers: FSDP2's strided shard of a tensor-parallel shard, and of a fused q|k|v shard
    assert results[0]["llama"]["placements"]["model.layers.0.mlp.gate_proj.weight"] == \
        "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    # torch 2.11's FSDP2 names its split of a block-wise shard a plain Shard (its rows are the same)
    assert results[0]["gpt2"]["placements"]["transformer.h.0.attn.c_attn.bias"] in (
        "(_StridedShard(dim=0, sf=2), _StridedShard(dim=0, sf=3))", "(Shard(dim=0), _StridedShard(dim=0, sf=3))")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layout", ["tp", "fsdp", "pp"])
def test_each_rank_reads_only_the_slices_it_holds(spawned, family, layout):
    for r in spawned:
        entry = r[f"{family}_{layout}"]
        assert entry["whole_reads"] == []
        assert entry["read"] == entry["local"]  # exactly this rank's elements, each once
        assert entry["largest_read"] <= entry["largest_local"]
        if layout != "tp":  # tensor parallelism keeps norms and biases whole on both ranks
            assert entry["read"] < 0.75 * entry["stored"]
        if layout != "pp":
            assert entry["wrong"] == []
    if layout != "pp":
        assert spawned[0][f"{family}_{layout}"]["dtensors"] > 0


def test_regions_match_the_layouts_torch_makes(spawned):
    for r in spawned:
        assert r["regions_right"] == [True] * 4


def test_a_mismatch_raises_on_every_rank_before_anything_is_allocated(spawned):
    messages = [r["mismatch"] for r in spawned]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "shape mismatch for 'model.layers.0.mlp.gate_proj.weight'" in messages[0]
    assert "the checkpoint has (80, 48)" in messages[0] and "the model (64, 48)" in messages[0]
    assert ".safetensors" in messages[0]
    assert all(r["mismatch_still_meta"] for r in spawned)


def test_export_then_load_under_another_layout_gives_the_same_logits(spawned):
    for r in spawned:
        assert r["round_trip"]["max_diff"] < 1e-5
        assert r["round_trip"]["tensors"] > 0


# ---------------------------------------------------------------------------------------------- without a mesh
def _phi3_config():
    from tests.models.tp_checks import family_config

    return family_config("phi3_gqa")  # q|k|v fused in blocks of unequal widths (fewer key/value heads)


MESHLESS = {"llama": _llama_config, "gpt2": _gpt2_config, "phi3": _phi3_config}


def _meshless_schedule(family, cfg=None, meta=True):
    """Slapo's way: the world group and no mesh, so build keeps the shards plain local tensors."""
    import transformers

    from schedlang.models import shard_model

    cfg = cfg or MESHLESS[family]()
    with schedlang.init_empty_weights() if meta else contextlib.nullcontext():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    sch = schedlang.create_schedule(model)
    shard_model(sch, gather_logits=True)
    return sch, cfg


def _logits_of(model, vocab):
    with torch.no_grad():
        return model(input_ids=_tokens(vocab)[:, :-1], use_cache=False).logits


def _spawned_meshless(rank, world, root):
    import safetensors
    import transformers

    from schedlang.distributed.dtensor_params import is_dtensor, named_shard_specs

    out = {}
    for family in MESHLESS:
        directory = os.path.join(root, family)
        sch, cfg = _meshless_schedule(family)
        specs = named_shard_specs(sch.mod)
        _RecordingHandle.original, _RecordingHandle.log = safetensors.safe_open, []
        safetensors.safe_open = _RecordingHandle  # put back before from_pretrained reads the files whole
        model, _ = schedlang.build(sch, pretrained=directory)
        safetensors.safe_open, log = _RecordingHandle.original, list(_RecordingHandle.log)
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
        stored = reference.state_dict()
        want = _logits_of(reference, cfg.vocab_size)
        got = _logits_of(model, cfg.vocab_size)
        # every shard is its record's slice of the stored tensor, and stays a plain tensor
        wrong = [n for n, p in model.named_parameters()
                 if not torch.equal(p.detach(), specs[n].slice_of(stored[n]) if n in specs else stored[n])]
        blocks = sorted({(s.groups, s.rank_major) for s in specs.values()})
        out[family] = {"logits": (got - want).abs().max().item(), "shape": tuple(got.shape),
                       "loss": (float(_loss(got, _tokens(cfg.vocab_size)[:, 1:])),
                                float(_loss(want, _tokens(cfg.vocab_size)[:, 1:]))),
                       "wrong": wrong, "sharded": sum(1 for n, _ in model.named_parameters() if n in specs),
                       "dtensors": sum(is_dtensor(p) for p in model.parameters()), "blocks": blocks,
                       "read": sum(n for _, n, _ in log), "local": sum(p.numel() for p in _local_tensors(model)),
                       "stored": sum(v.numel() for v in stored.values()),
                       "whole_reads": sum(how == "whole" for _, _, how in log)}
        # load_pretrained into a built model with other (random) weights, and export_hf of the loaded model
        torch.manual_seed(rank + 7)
        sch, _ = _meshless_schedule(family, cfg, meta=False)
        other, _ = schedlang.build(sch)
        before = (_logits_of(other, cfg.vocab_size) - want).abs().max().item()
        info = schedlang.load_pretrained(other, directory)
        exported = schedlang.export_hf(other, os.path.join(root, f"exported_{family}"))
        again = transformers.AutoModelForCausalLM.from_pretrained(exported)
        out[family].update(
            loaded_before=before, loaded=(_logits_of(other, cfg.vocab_size) - want).abs().max().item(),
            tensors=info["tensors"], exported=(_logits_of(again, cfg.vocab_size) - want).abs().max().item(),
            exported_equal=[n for n, v in again.state_dict().items() if not torch.equal(v, stored[n])])
    # a real mismatch names the model's full shape, this rank's shard and how it is split, on both paths
    messages = []
    sch, _ = _meshless_schedule("llama", _llama_config(intermediate_size=64))
    try:
        schedlang.build(sch, pretrained=os.path.join(root, "llama"))
    except schedlang.CheckpointError as e:
        messages.append(str(e))
    out["still_meta"] = all(p.is_meta for p in sch.mod.parameters())
    sch, _ = _meshless_schedule("gpt2", _gpt2_config(n_embd=48), meta=False)
    model, _ = schedlang.build(sch)
    try:
        schedlang.load_pretrained(model, os.path.join(root, "gpt2"))
    except schedlang.CheckpointError as e:
        messages.append(str(e))
    out["mismatches"] = messages
    return out


@pytest.fixture(scope="module")
def meshless(tmp_path_factory):
    import transformers

    root = str(tmp_path_factory.mktemp("meshless"))
    for family, config in MESHLESS.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(
            os.path.join(root, family), **({"max_shard_size": "40KB"} if family == "llama" else {}))
    return run_distributed(_spawned_meshless, world_size=2, args=(root,), timeout=300)


@pytest.mark.parametrize("family", list(MESHLESS))
def test_without_a_mesh_plain_shards_load_their_slices_of_the_checkpoint(meshless, family):
    for r in meshless:
        entry = r[family]
        assert entry["dtensors"] == 0 and entry["sharded"] > 0
        assert entry["wrong"] == []
        assert entry["shape"][-1] == MESHLESS[family]().vocab_size  # the gathered logits of the whole vocabulary
        assert entry["logits"] < 1e-5
        assert entry["loss"][0] == pytest.approx(entry["loss"][1], rel=1e-6, abs=1e-6)
        # each rank reads exactly its own elements, each once, as slices
        assert entry["whole_reads"] == 0 and entry["read"] == entry["local"] < entry["stored"]
    # the layouts this covers: GPT-2's q|k|v and Phi-3's gate|up in equal blocks, Phi-3's q|k|v in unequal ones
    covered = {"llama": [(1, False)], "gpt2": [(1, False), (3, False)], "phi3": [(1, False), (2, False), (3, True)]}
    assert meshless[0][family]["blocks"] == covered[family]


@pytest.mark.parametrize("family", list(MESHLESS))
def test_without_a_mesh_load_pretrained_and_export_hf_round_trip(meshless, family):
    for r in meshless:
        entry = r[family]
        assert entry["loaded_before"] > 1e-2  # the model had other weights before the load
        assert entry["loaded"] < 1e-5 and entry["tensors"] > 0
        assert entry["exported"] < 1e-5 and entry["exported_equal"] == []


def test_without_a_mesh_a_mismatch_names_the_full_shape_and_the_shard(meshless):
    for r in meshless:
        build, load = r["mismatches"]
        assert ("shape mismatch for 'model.layers.0.mlp.gate_proj.weight': the checkpoint has (80, 48) (tensor "
                "'model.layers.0.mlp.gate_proj.weight' in ") in build
        assert ".safetensors), the model (64, 48); this rank's shard is (32, 48), split along axis 0 over 2 " \
               "ranks\n" in build
        assert ("shape mismatch for 'transformer.h.0.attn.c_attn.weight': the checkpoint has (32, 96) (tensor "
                "'transformer.h.0.attn.c_attn.weight' in ") in load
        assert "model.safetensors), the model (48, 144); this rank's shard is (48, 72), split along axis 1 in 3 " \
               "blocks over 2 ranks\n" in load
        assert r["still_meta"]
    assert meshless[0]["mismatches"] == meshless[1]["mismatches"]


# ---------------------------------------------------------------------------------------------- one process
def _empty(family, cfg=None):
    with schedlang.init_empty_weights():
        return schedlang.create_schedule(_model_class(family)(cfg or FAMILIES[family][0]()))


def _state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("axis,groups,blocks", [(0, 1, None), (1, 1, None), (1, 3, None), (0, 3, (8, 4, 4)),
                                                 (1, 2, (12, 4))])
@pytest.mark.parametrize("world", [2, 4])
def test_regions_of_a_plain_shard_are_its_slices_of_the_unsharded_tensor(axis, groups, blocks, world):
    from schedlang.pretrained import local_regions
    from schedlang.shard_spec import ShardSpec

    shape = [7, 13]
    shape[axis] = sum(blocks) if blocks is not None else 12 * groups if groups > 1 else 4 * world
    full = torch.randn(shape)
    for rank in range(world):
        spec = ShardSpec(axis, world, rank, tuple(full.shape), groups, blocks)
        local = spec.slice_of(full)
        regions = local_regions(local, spec)
        assert sum(local[li].numel() for li, _ in regions) == local.numel()
        assert all(torch.equal(local[li], full[gi]) for li, gi in regions)
    # a tensor of another shape than its spec's shard
    with pytest.raises(schedlang.CheckpointError) as info:
        local_regions(torch.zeros(8, 13), ShardSpec(0, 2, 1, (8, 13)))
    assert str(info.value) == ("pretrained: cannot tell which part of a tensor of shape (8, 13) placed as "
                               "(Shard(dim=0),) this rank holds (computed (4, 13), local (8, 13)); the placements "
                               "read are Shard, _StridedShard, Replicate and Partial")


@pytest.mark.parametrize("stored,loaded", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.float16, torch.float32)])
def test_checkpoint_dtype_is_converted_to_the_model_dtype(tmp_path, stored, loaded):
    reference = _save("gpt2", tmp_path, dtype=stored)
    model, _ = schedlang.build(_empty("gpt2"), pretrained=tmp_path, dtype=loaded)
    want = _state(reference)
    got = _state(model)
    assert {v.dtype for v in got.values()} == {loaded}
    for name, value in want.items():
        assert torch.equal(got[name], value.to(loaded)), name


def test_tensors_split_across_files_with_an_index_and_untied_weights(tmp_path):
    cfg = _llama_config(tie_word_embeddings=False)
    torch.manual_seed(1)
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM(cfg)
    reference.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, _ = schedlang.build(_empty("llama", cfg), pretrained=tmp_path, device="cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    got = _state(model)
    for name, value in _state(reference).items():
        assert torch.equal(got[name], value), name
    # the rotary cache is not in the checkpoint: it keeps the value the model computed
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


def test_a_meta_model_is_materialized_on_the_default_device(tmp_path):
    from schedlang.distributed.groups import default_device

    _save("gpt2", tmp_path)
    model, _ = schedlang.build(_empty("gpt2"), pretrained=tmp_path)
    # the current GPU when there is one (no process group here), else the CPU
    assert {p.device for p in model.parameters()} == {default_device()}


def test_rotary_caches_on_the_meta_device_are_computed_not_read(tmp_path):
    reference = _save("llama", tmp_path)
    with schedlang.init_empty_weights(include_buffers=True):  # buffers on the meta device too
        sch = schedlang.create_schedule(_model_class("llama")(_llama_config()))
    model, _ = schedlang.build(sch, pretrained=tmp_path, device="cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    tokens = _tokens(96)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)


def test_a_single_file_and_a_list_of_files_load_too(tmp_path):
    reference = _save("gpt2", tmp_path)
    for source in (tmp_path / "model.safetensors", [str(tmp_path / "model.safetensors")]):
        model, _ = schedlang.build(_empty("gpt2"), pretrained=source, device="cpu")
        assert torch.equal(model.transformer.h[1].attn.c_attn.weight, reference.transformer.h[1].attn.c_attn.weight)
        assert model.lm_head.weight is model.transformer.wte.weight


def test_a_base_model_checkpoint_loads_into_the_causal_lm(tmp_path):
    reference = _save("llama", tmp_path / "lm")
    reference.model.save_pretrained(tmp_path / "base")  # keys without the "model." prefix
    model, _ = schedlang.build(_empty("llama"), pretrained=tmp_path / "base", device="cpu")
    got = _state(model)
    for name, value in _state(reference).items():
        assert torch.equal(got[name], value), name


def test_load_pretrained_into_a_built_model(tmp_path):
    reference = _save("gpt2", tmp_path)
    torch.manual_seed(3)
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config())
    info = schedlang.load_pretrained(model, tmp_path)
    assert info["tensors"] == len({id(t) for t in model.state_dict(keep_vars=True).values()})  # the tie once
    tokens = _tokens(64)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, reference(input_ids=tokens).logits, rtol=0,
                                   atol=0)


def test_load_pretrained_into_wrapped_modules(tmp_path):
    """A module wrapped by torch.compile (its tensors named ``..._orig_mod...``) loads through torch's distributed
    state dict, which takes the wrapper's name off; a plain model's own tensors are written directly."""
    reference = _save("gpt2", tmp_path)
    from transformers import GPT2LMHeadModel

    from schedlang.pretrained import _state_dict_of

    model = GPT2LMHeadModel(_gpt2_config())
    model.transformer.h[0] = torch.compile(model.transformer.h[0])  # never called: nothing compiles
    assert _state_dict_of(model)[1] is True
    info = schedlang.load_pretrained(model, tmp_path)
    assert info["tensors"] == len({id(t) for t in model.state_dict(keep_vars=True).values()})
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name.replace("._orig_mod", "")], rtol=0, atol=0)
    plain = GPT2LMHeadModel(_gpt2_config())
    state, copies = _state_dict_of(plain)
    assert copies is False and state["transformer.wte.weight"] is plain.transformer.wte.weight


def _rewrite(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_a_name_the_model_lacks_is_named_with_its_file(tmp_path):
    _save("gpt2", tmp_path)
    _rewrite(tmp_path / "model.safetensors", lambda t: t.update({"transformer.h.9.mlp.c_fc.weight": torch.ones(2)}))
    sch = _empty("gpt2")
    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.build(sch, pretrained=tmp_path)
    assert "1 tensor(s) in the checkpoint are not in the model: 'transformer.h.9.mlp.c_fc.weight'" in str(info.value)
    assert str(tmp_path / "model.safetensors") in str(info.value)
    assert all(p.is_meta for p in sch.mod.parameters())  # nothing allocated


def test_a_name_the_checkpoint_lacks_is_named(tmp_path):
    _save("gpt2", tmp_path)
    _rewrite(tmp_path / "model.safetensors", lambda t: t.pop("transformer.h.1.ln_2.bias"))
    with pytest.raises(schedlang.CheckpointError, match=r"1 tensor\(s\) of the model are not in the checkpoint: "
                                                        r"'transformer.h.1.ln_2.bias'"):
        schedlang.build(_empty("gpt2"), pretrained=tmp_path)
    # with strict=False the rest loads and the missing tensor keeps its value
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config())
    before = model.transformer.h[1].ln_2.bias.detach().clone()
    schedlang.load_pretrained(model, tmp_path, strict=False)
    assert torch.equal(model.transformer.h[1].ln_2.bias, before)


def test_a_shape_mismatch_names_the_tensor_both_shapes_and_the_file(tmp_path):
    _save("gpt2", tmp_path)
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config(n_inner=40))
    before = _state(model)
    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.load_pretrained(model, tmp_path)
    message = str(info.value)
    assert "shape mismatch for 'transformer.h.0.mlp.c_fc.weight': the checkpoint has (32, 72)" in message
    assert "the model (32, 40)" in message and str(tmp_path / "model.safetensors") in message
    assert all(torch.equal(v, before[k]) for k, v in _state(model).items())  # nothing loaded half-way


def test_a_checkpoint_of_another_width_names_a_few_mismatches_and_counts_the_rest(tmp_path):
    _save("gpt2", tmp_path)
    from transformers import GPT2LMHeadModel

    with pytest.raises(schedlang.CheckpointError) as info:
        schedlang.load_pretrained(GPT2LMHeadModel(_gpt2_config(n_embd=16, n_inner=40)), tmp_path)
    lines = str(info.value).splitlines()
    assert sum(line.startswith("  shape mismatch for ") for line in lines) == 8
    assert re.fullmatch(r"  \.\.\. and \d+ more shape mismatches", lines[-1])


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(schedlang.CheckpointError, match="does not exist"):
        schedlang.build(_empty("gpt2"), pretrained=tmp_path / "nowhere")
    with pytest.raises(schedlang.CheckpointError, match="holds no .safetensors file"):
        schedlang.build(_empty("gpt2"), pretrained=tmp_path)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(schedlang.CheckpointError, match="cannot read .*broken.safetensors as safetensors"):
        schedlang.build(_empty("gpt2"), pretrained=tmp_path)
    _save("llama", tmp_path / "sharded", max_shard_size="40KB")
    first = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(schedlang.CheckpointError, match=f"{first.name} is missing"):
        schedlang.build(_empty("llama"), pretrained=tmp_path / "sharded")
