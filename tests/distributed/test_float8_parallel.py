"""float8 Linears composed with FSDP2, tensor parallelism and the fused optimizer (2 gloo ranks).

Float8 scales are dynamic: a data-parallel rank scales its own slice of the batch, a tensor-parallel
rank its own shard of the weight, so a layout does not reproduce one process bit for bit. The test
holds each layout's losses to the one-process float8 run within float8's rounding, and checks that
float8 was really on (its losses differ from the high-precision run).
"""

import pytest
import torch
import torch.distributed as dist

import schedlang
from schedlang.distributed.launch import run_distributed
from schedlang.distributed.mesh import make_mesh
from schedlang.primitives.float8 import is_float8

pytest.importorskip("torchao.float8", reason="torchao not installed (pip install 'schedlang[fp8]')")

STEPS, BATCH, SEQ, LR = 3, 4, 16, 1e-2


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _float8_layers(sch):
    for i in range(2):
        sch[f"model.layers.{i}"].float8(min_features=16)


def _train(model, opt, rows=slice(None)):
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (BATCH, SEQ + 1), generator=g)[rows]
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _one_process(use_float8, optimizer=torch.optim.AdamW):
    sch = schedlang.create_schedule(_model())
    if use_float8:
        _float8_layers(sch)
    model, opt = schedlang.build(sch, optimizer=optimizer, lr=LR)
    return [float(x) for x in _train(model, opt)]


def _layout(kind):
    from schedlang.models import shard_model

    dp, tp = (2, 1) if kind == "fsdp" else (1, 2)
    sch = schedlang.create_schedule(_model(), mesh=make_mesh(dp=dp, tp=tp, device_type="cpu"))
    if tp > 1:
        # the ready-made schedule converts the layers after sharding them: float8 checks the local shards
        shard_model(sch, gather_logits=True, float8={"recipe": "tensorwise", "min_features": 16})
    else:
        _float8_layers(sch)
    if dp > 1:
        for i in range(2):
            sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=LR)
    n_float8 = sum(is_float8(m) for m in model.modules())
    per = BATCH // dp
    rank = dist.get_rank()
    losses = _train(model, opt, rows=slice(rank * per, (rank + 1) * per) if dp > 1 else slice(None))
    out = []
    for loss in losses:
        if dp > 1:
            loss = loss / dp
            dist.all_reduce(loss)
        out.append(float(loss))
    return out, n_float8


def _worker(rank, world):
    return {"fp32": _one_process(False), "float8": _one_process(True),
            "fsdp": _layout("fsdp"), "tp": _layout("tp")}


def test_float8_with_fsdp2_and_tensor_parallelism_trains_like_one_process():
    for result in run_distributed(_worker, world_size=2, timeout=240):
        ref, high = result["float8"], result["fp32"]
        assert max(abs(a - b) for a, b in zip(ref, high)) > 1e-5  # float8 rounding is there
        for kind in ("fsdp", "tp"):
            losses, n_float8 = result[kind]
            assert n_float8 == 14, kind  # 7 Linears per layer, the LM head stays
            for a, b in zip(losses, ref):
                assert abs(a - b) / b < 0.02, (kind, losses, ref)


def test_float8_with_the_fused_optimizer():
    fused = _one_process(True, optimizer="adamw")
    plain = _one_process(True)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=1e-4, atol=1e-4)


def test_shard_model_float8_argument_is_checked():
    from schedlang.models import shard_model

    sch = schedlang.create_schedule(_model())
    with pytest.raises(schedlang.ScheduleTypeError, match=r"shard_model: float8 must be None, a recipe name"):
        shard_model(sch, float8=8)
    assert len(sch.plan) == 0
