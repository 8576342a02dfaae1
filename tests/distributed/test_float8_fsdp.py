"""Float8 all-gather under FSDP2 (2 gloo ranks): the scales stored after each step are the whole weights'
scales, training is what it is without them, and a loaded checkpoint drops the stale ones."""

import pytest
import torch
import torch.distributed as dist

import schedlang
from schedlang.distributed.float8_fsdp import float8_all_gather_linears, precompute_scales_after_step
from schedlang.distributed.launch import run_distributed
from schedlang.distributed.mesh import make_mesh

pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")

from tests.distributed.test_float8_parallel import BATCH, LR, _model, _one_process, _train  # noqa: E402


def _built(all_gather: bool, optimizer=torch.optim.AdamW):
    sch = schedlang.create_schedule(_model(), mesh=make_mesh(dp=2, tp=1, device_type="cpu"))
    for i in range(2):
        sch[f"model.layers.{i}"].float8(min_features=16, fsdp_float8_all_gather=all_gather)
    for i in range(2):
        sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
    sch.fully_shard(mp_policy="fp32")
    return schedlang.build(sch, optimizer=optimizer, **({"lr": LR} if optimizer else {}))


def _losses(model, opt, rank):
    per = BATCH // 2
    out = []
    for loss in _train(model, opt, rows=slice(rank * per, (rank + 1) * per)):
        loss = loss / 2
        dist.all_reduce(loss)
        out.append(float(loss))
    return out


def _worker(rank, world, path):
    import torchao.float8 as float8

    result = {"one_process": _one_process(True)}
    model, opt = _built(all_gather=True)  # build registers the precompute hook
    linears = float8_all_gather_linears(model)
    result["count"] = len(linears)
    result["before"] = [m.weight._local_tensor._precomputed_scale for m in linears]
    result["stored"] = _losses(model, opt, rank)
    fp8_max = torch.finfo(float8.Float8LinearConfig().cast_config_weight.target_dtype).max
    errors = []
    for m in linears:  # what was stored is the scale of the whole (gathered) weight after the last step
        stored = m.weight._local_tensor._precomputed_scale
        whole = (fp8_max / m.weight.detach().full_tensor().abs().max().double()).float()
        errors.append(float((stored - whole).abs() / whole))
    result["scale_errors"] = errors
    schedlang.save_checkpoint(path, model, opt, step=3)
    schedlang.load_checkpoint(path, model, opt)
    result["after_load"] = [m.weight._local_tensor._precomputed_scale for m in linears]
    # without the hook: each all-gather all-reduces its weight's amax itself; build says how to add it
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("schedlang.build").addHandler(handler)
    try:
        model, _ = _built(all_gather=True, optimizer=None)
    finally:
        logging.getLogger("schedlang.build").removeHandler(handler)
    result["warned"] = [m for m in said if "precompute_scales_after_step" in m]
    result["dynamic"] = _losses(model, torch.optim.AdamW(model.parameters(), lr=LR), rank)
    # schedlang's fused AdamW (what build(optimizer="adamw") makes) updates the float8 weight wrappers in place
    model, opt = _built(all_gather=True, optimizer="adamw")
    result["fused_optimizer"] = type(opt).__name__
    result["fused"] = _losses(model, opt, rank)
    model, opt = _built(all_gather=False)
    result["plain_count"] = len(float8_all_gather_linears(model))
    result["plain_handle"] = precompute_scales_after_step(model, opt)
    result["plain"] = _losses(model, opt, rank)
    return result


def test_float8_all_gather_stores_the_whole_weights_scales_after_each_step(tmp_path):
    for result in run_distributed(_worker, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=300):
        assert result["count"] == 14  # 7 Linears in each of the 2 layers
        assert result["before"] == [None] * 14  # nothing stored before the first step
        assert max(result["scale_errors"]) < 1e-6, result["scale_errors"]
        assert result["after_load"] == [None] * 14  # stale once the weights were replaced
        # the same training with the scales stored or computed inside each all-gather
        torch.testing.assert_close(torch.tensor(result["stored"]), torch.tensor(result["dynamic"]), rtol=1e-6,
                                   atol=0)
        # and float8 all-gather trains like float8 in one process and like float8 gathered in full precision
        for a, b, c in zip(result["stored"], result["one_process"], result["plain"]):
            assert abs(a - b) / b < 0.02 and abs(a - c) / c < 0.02, result
        assert result["fused_optimizer"] == "FusedAdamW"
        torch.testing.assert_close(torch.tensor(result["fused"]), torch.tensor(result["stored"]), rtol=1e-5, atol=0)
        assert result["plain_count"] == 0 and result["plain_handle"] is None
        assert result["warned"] == [
            "build: 14 float8 all-gathered weight(s) and no optimizer made here: after making yours, call "
            "schedlang.distributed.float8_fsdp.precompute_scales_after_step(model, optimizer), or each all-gather "
            "all-reduces its own weight's amax (a small collective per Linear per step)"]
