"""Context parallelism on gloo: loss, logits (gathered to global order) and every parameter gradient equal
a single process's, for LLaMA (GQA), Qwen3, Mistral (sliding window) and Gemma-2 (sliding layers, soft-capped
scores), with cp alone, and with tensor parallelism, FSDP2 and HSDP beside it."""

import copy

import pytest
import torch

from schedlang.distributed.launch import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=128, max_position_embeddings=128)


def _model(family: str, seed: int = 0):
    import transformers as tf

    if family == "llama":
        config = tf.LlamaConfig(**SIZES)
    elif family == "qwen3":
        config = tf.Qwen3Config(**SIZES, head_dim=16)
    elif family == "mistral":
        config = tf.MistralConfig(**SIZES, sliding_window=5)
    elif family == "gemma2":
        config = tf.Gemma2Config(**SIZES, head_dim=16, sliding_window=5, attn_logit_softcapping=30.0,
                                 final_logit_softcapping=None, query_pre_attn_scalar=16)
    else:
        raise AssertionError(family)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    torch.manual_seed(seed)
    model = getattr(tf, {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                         "gemma2": "Gemma2ForCausalLM"}[family])(config)
    with torch.no_grad():  # random norms, so a wrong token order cannot hide behind unit scales
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.rand_like(p) * 0.5)
    return model


def _full(t):
    from schedlang.checkpoint import full_tensor

    return full_tensor(t)


def _case(family, mesh_sizes, length, tp=False, fsdp=False):
    import schedlang
    from schedlang.distributed.mesh import make_mesh

    reference = _model(family)
    mesh = make_mesh(**mesh_sizes)
    sch = schedlang.create_schedule(copy.deepcopy(reference), mesh=mesh)
    if tp:
        from schedlang.models import shard_model

        shard_model(sch, gather_logits=True)
    sch.context_parallel()
    if fsdp:
        for i in range(2):
            sch[f"model.layers.{i}"].fully_shard(mp_policy="fp32")
        sch.fully_shard(mp_policy="fp32")
    model, _ = schedlang.build(sch, optimizer=torch.optim.SGD, lr=0.1)
    if "dp_replicate" in mesh.mesh_dim_names:  # HSDP: the replicas' rows follow one another
        shard = mesh["dp_shard"].size()
        data_rank = mesh["dp_replicate"].get_local_rank() * shard + mesh["dp_shard"].get_local_rank()
        data_ranks = mesh["dp_replicate"].size() * shard
    else:
        data_rank, data_ranks = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2 * data_ranks, length))
    rows = slice(2 * data_rank, 2 * data_rank + 2)
    logits = model(tokens[rows]).logits
    loss = schedlang.context_parallel_loss(logits, tokens[rows], model)
    loss.backward()
    gathered = schedlang.gather_context_parallel(logits.detach(), 1, model)

    ref_out = reference(tokens[rows], labels=tokens[rows])
    # the data-parallel mean over data ranks, as FSDP averages it
    ref_loss = torch.nn.functional.cross_entropy(
        reference(tokens).logits[:, :-1].reshape(-1, 128).float(), tokens[:, 1:].reshape(-1), reduction="none"
    ).view(data_ranks, -1).mean(1).mean()
    reference.zero_grad()
    ref_loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    worst = max(float((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-6))
                for n, p in reference.named_parameters())
    missing = sorted(n for n, p in reference.named_parameters() if n not in grads)
    return {"loss": float(loss), "ref_loss": float(ref_out.loss), "logits": float((gathered - ref_out.logits).abs().max()),
            "grad": worst, "missing": missing, "local_len": logits.shape[1]}


def _worker(rank, world, cases):
    return {name: _case(*args) for name, args in cases.items()}


def _check(results):
    for rank_results in results:
        for name, r in rank_results.items():
            assert r["missing"] == [], name
            assert abs(r["loss"] - r["ref_loss"]) < 1e-5, (name, r)
            assert r["logits"] < 2e-5, (name, r)
            assert r["grad"] < 1e-4, (name, r)


def test_cp_alone_world2_four_families():
    cases = {f: (f, {"cp": 2}, length) for f, length in
             [("llama", 12), ("qwen3", 20), ("mistral", 20), ("gemma2", 12)]}
    results = run_distributed(_worker, world_size=2, args=(cases,), timeout=240)
    _check(results)
    assert results[0]["llama"]["local_len"] == 6


def test_cp_world4_alone_and_beside_tp_fsdp_hsdp():
    cases = {"cp4": ("mistral", {"cp": 4}, 24),
             "cp2_tp2": ("qwen3", {"cp": 2, "tp": 2}, 12, True),
             "dp2_cp2_fsdp": ("gemma2", {"cp": 2, "dp": 2}, 20, False, True),
             "cp2_tp2_fsdp": ("llama", {"cp": 2, "tp": 2}, 12, True, True),
             "hsdp2_cp2": ("llama", {"dp_replicate": 2, "cp": 2}, 20, False, True)}
    _check(run_distributed(_worker, world_size=4, args=(cases,), timeout=300))
