"""The search over the layouts of a cluster: tensor parallelism inside a node, FSDP / HSDP / DDP, pipelines,
checkpointing modes and gradient accumulation to reach the global batch; the runners-up and why they lost."""

import dataclasses

import pytest

from schedlang.autotune.training_cost import GIB, Hardware, Layout, candidate_layouts, choose_layout

from .shapes import LLAMA3_70B, LLAMA3_405B

FAST = Layout(dtype="bf16", optimize=True, compiled=True, optimizer="fused-adamw")
TP = [1, 2, 4, 8]


def _h100s(world):
    return Hardware.nominal("cuda", "NVIDIA H100", memory_gib=80, world=world)


def test_every_candidate_covers_the_global_batch_and_keeps_tp_inside_a_node():
    layouts = candidate_layouts(LLAMA3_70B, 64, 64, FAST, TP, gpus_per_node=4)
    assert layouts and max(l.tp for l in layouts) == 4  # nodes of 4 GPUs: no tp=8
    for lay in layouts:
        assert lay.pp * lay.dp * lay.tp == 64
        local = 64 // (lay.dp * lay.microbatches)
        assert local * lay.microbatches * lay.dp == 64
        if lay.dp_mode == "hsdp":
            assert lay.dp_replicate * lay.dp_shard == lay.dp and 1 < lay.dp_replicate < lay.dp
    found = {(l.dp_mode, l.activation_checkpoint, l.microbatches > 1 and l.pp == 1) for l in layouts}
    for mode in ("fsdp", "hsdp", "ddp"):
        for ac in ("none", "selective", "full"):
            assert (mode, ac, True) in found and (mode, ac, False) in found, (mode, ac)


def test_what_the_user_fixed_every_candidate_keeps():
    fixed = {"tp": 8, "activation_checkpoint": "selective", "sp": True, "dp_mode": "hsdp", "dp_replicate": 2}
    layouts = candidate_layouts(LLAMA3_70B, 64, 64, FAST, TP, fixed, gpus_per_node=8)
    assert layouts and all((l.tp, l.activation_checkpoint, l.sp, l.dp_mode, l.dp_replicate) ==
                           (8, "selective", True, "hsdp", 2) for l in layouts)
    allowed = candidate_layouts(LLAMA3_70B, 64, 64, FAST, TP, {"dp_modes": ("fsdp",), "checkpoint_modes": ("full",)},
                                gpus_per_node=8)
    assert {(l.dp_mode, l.activation_checkpoint) for l in allowed} == {("fsdp", "full")}


def test_70b_on_8_nodes_keeps_tensor_parallelism_inside_the_node():
    """64 H100s, global batch 64 x 8192: pure FSDP over 64 ranks all-gathers the whole model over the network
    for every microbatch; tp inside the node (NVLink) with FSDP across nodes moves a tp-th of it."""
    choice = choose_layout(LLAMA3_70B, _h100s(64), 64, 64, 8192, base=FAST, tp_sizes=TP)
    best = choice.best.layout
    assert best.tp > 1 and best.pp == 1 and choice.best.fits
    assert {c.link for c in choice.best.collectives if c.group == "tp"} == {"intra-node"}
    pure = [e for e in choice.ranked if (e.layout.tp, e.layout.pp) == (1, 1)]
    # pure FSDP cannot even be built: a rank allocates the whole model in fp32 (282 GB) before FSDP2 shards it
    assert pure and all(not e.fits and e.build_bytes > e.memory_limit for e in pure)
    fsdp = min((e for e in pure if e.layout.dp_mode == "fsdp"), key=lambda e: e.step_s)
    assert fsdp.comm_exposed_s > choice.best.comm_exposed_s  # and were it built, its all-gathers would show


def test_405b_on_512_gpus_names_its_runners_up_and_why_they_lost():
    choice = choose_layout(LLAMA3_405B, _h100s(512), 512, 1024, 8192, base=FAST, tp_sizes=TP)
    assert choice.best.fits and len(choice.runners_up) >= 3
    meshes = {(r.estimate.layout.pp, r.estimate.layout.dp, r.estimate.layout.tp, r.estimate.layout.dp_mode)
              for r in choice.runners_up}
    assert len(meshes) == len(choice.runners_up)  # each a different mesh
    for r in choice.runners_up:
        e = r.estimate
        if e.fits:
            slower = 100 * (e.step_s / choice.best.step_s - 1)
            assert r.why.startswith(f"slower by {slower:.1f}%") and e.step_s >= choice.best.step_s
        else:
            assert r.why.startswith("does not fit: ") and f"{(e.peak_bytes - e.memory_limit) / GIB:.1f} GiB over" in r.why


def test_accumulation_reaches_a_global_batch_one_pass_could_not_hold():
    """70B, 64 ranks, 256 x 8192: the sequences of a dp rank at once fit no layout; accumulation does."""
    choice = choose_layout(LLAMA3_70B, _h100s(64), 64, 256, 8192, base=FAST, tp_sizes=TP)
    best = choice.best.layout
    assert best.microbatches > 1 and best.pp == 1 and choice.best.fits
    alone = choose_layout(LLAMA3_70B, _h100s(64), 64, 256, 8192, base=FAST, tp_sizes=TP,
                          fixed={"microbatches": 1})
    assert not alone.best.fits
    assert "accumulation steps of" in choice.reason


def test_no_layout_of_the_world_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no layout of 3 ranks fits global batch 4"):
        choose_layout(LLAMA3_70B, _h100s(3), 3, 4, 2048, base=FAST, tp_sizes=[1])


def test_the_fastest_fitting_layout_wins():
    choice = choose_layout(LLAMA3_70B, _h100s(64), 64, 64, 8192, base=FAST, tp_sizes=TP)
    fitting = [e for e in choice.ranked if e.fits]
    assert choice.best.step_s == pytest.approx(min(e.step_s for e in fitting))
    assert choice.best.total_bytes <= 0.9 * 80 * GIB
    # a faster link between nodes makes data parallelism over the network cheaper, never the best slower
    fast = choose_layout(LLAMA3_70B, dataclasses.replace(_h100s(64), inter_bytes_per_s=400e9), 64, 64, 8192,
                         base=FAST, tp_sizes=TP)
    assert fast.best.step_s <= choice.best.step_s


def test_a_launched_run_gets_selective_checkpointing_without_pipelines_only():
    fixed = {"selective_with_pipelines": False}
    layouts = candidate_layouts(LLAMA3_70B, 64, 64, FAST, TP, fixed, gpus_per_node=8)
    assert any(l.activation_checkpoint == "selective" and l.pp == 1 for l in layouts)
    assert not any(l.activation_checkpoint == "selective" and l.pp > 1 for l in layouts)
    assert any(l.activation_checkpoint == "full" and l.pp > 1 for l in layouts)
