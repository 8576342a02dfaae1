"""Tensor-parallel BERT (transformers 5.x, ``BertForMaskedLM``) with ``schedlang.models.bert.shard_bert``.

The MLM decoder stays tied to the vocabulary-parallel word embeddings (weight) and to
``cls.predictions.bias`` (bias); logits, loss and every gradient equal the single-device model's.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import schedlang
from schedlang.distributed.cross_entropy import vocab_parallel_cross_entropy
from schedlang.models.bert import shard_bert
from tests.helpers.distributed import run_distributed
from tests.models import tp_checks as T

SEQ = 9


def _inputs():
    ids = torch.randint(0, T.VOCAB, (2, SEQ), device=T.device())
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]  # the masked-LM loss counts only some positions
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding
    return ids, labels, mask


def _model():
    from transformers import BertForMaskedLM

    return BertForMaskedLM(T.bert_config()).to(T.device())


def _mlm_loss(labels):
    def loss(out, full):
        logits = out.logits
        if full:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return vocab_parallel_cross_entropy(logits, labels)

    return loss


def _tp_vocab_parallel_loss():
    model = _model()
    ids, labels, mask = _inputs()
    sch = schedlang.create_schedule(model)
    shard_bert(sch)
    built, _ = schedlang.build(sch)
    result = T.compare(built, copy.deepcopy(model), {"input_ids": ids, "attention_mask": mask}, logits_split=True,
                       loss_fn=_mlm_loss(labels))
    preds = built.cls.predictions
    result.update(tied=(preds.decoder.weight is built.bert.embeddings.word_embeddings.weight,
                        preds.decoder.bias is preds.bias),
                  heads=built.bert.encoder.layer[0].attention.self.num_attention_heads,
                  n_params=len(list(model.named_parameters(remove_duplicate=False))))
    return result


def _verify_and_gathered_logits():
    model = _model()
    ids, labels, mask = _inputs()
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids], example_kwargs={"attention_mask": mask}):
        shard_bert(sch, gather_logits=True)
    built, _ = schedlang.build(sch)
    return T.compare(built, copy.deepcopy(model), {"input_ids": ids, "attention_mask": mask, "labels": labels},
                     logits_split=False)


def _verify_catches_wrong_axis():
    model = _model()
    ids, _, _ = _inputs()
    sch = schedlang.create_schedule(model)
    try:
        with schedlang.Verify(sch, example_inputs=[ids]):
            layer = sch["bert.encoder.layer.0"]
            layer["intermediate.dense"].shard("weight", axis=1)  # wrong: should be the outputs (axis 0) + bias
            layer["output.dense"].shard("weight", axis=1)
            layer["output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            layer["intermediate"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    except schedlang.VerificationError as e:
        return str(e)
    return None


def _meta_build():
    from transformers import BertForMaskedLM

    with schedlang.init_empty_weights():
        meta = BertForMaskedLM(T.bert_config())
    sch = schedlang.create_schedule(meta)
    shard_bert(sch)
    torch.manual_seed(5)
    sharded, _ = schedlang.build(sch, device=T.device())
    torch.manual_seed(5)
    full, _ = schedlang.build(schedlang.create_schedule(meta), device=T.device())
    ids, labels, mask = _inputs()
    result = T.compare(sharded, full, {"input_ids": ids, "attention_mask": mask}, logits_split=True,
                       loss_fn=_mlm_loss(labels))
    whole = ("position_embeddings", "token_type_embeddings", "LayerNorm", "predictions.transform",
             "output.dense.bias")
    replicated = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if any(w in n for w in whole))
    result["bytes"] = (T.param_bytes(sharded), T.param_bytes(full), replicated)
    result["padding_row_zero"] = bool(full.bert.embeddings.word_embeddings.weight[0].eq(0).all())
    return result


def _world2(rank, world):
    return T.run_scenarios({"tp": _tp_vocab_parallel_loss, "verify": _verify_and_gathered_logits,
                            "wrong_axis": _verify_catches_wrong_axis, "meta": _meta_build})


@pytest.fixture(scope="module")
def world2():
    return run_distributed(_world2, world_size=2, timeout=240)


def test_logits_loss_and_gradients_match_single_device(world2):
    for r in T.value(world2, "tp"):
        T.assert_matches(r)
        assert r["local_vocab"] == T.VOCAB // 2
        assert r["grads_compared"] == r["n_params"]
        assert r["tied"] == (True, True)
        assert r["heads"] == 2


def test_verify_passes_with_gathered_logits(world2):
    for r in T.value(world2, "verify"):
        T.assert_matches(r)


def test_verify_catches_wrong_shard_axis(world2):
    for m in T.value(world2, "wrong_axis"):
        assert m is not None, "Verify accepted intermediate.dense split along its inputs"
        assert "does not match the original model" in m
        assert "shard at 'bert.encoder.layer.0.intermediate.dense' (tensor_name='weight', axis=1)" in m


def test_meta_build(world2):
    for r in T.value(world2, "meta"):
        T.assert_matches(r)
        assert r["padding_row_zero"] is True
        # position / token-type embeddings, norms, row-parallel biases and the MLM transform stay whole
        sharded, full, replicated = r["bytes"]
        assert sharded == (full - replicated) // 2 + replicated
        assert sharded / full < 0.57
