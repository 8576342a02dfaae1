"""The report's training plan: the layout a schedule's plan writes, estimated as schedlang train --dry-run
prints it."""

from __future__ import annotations

import torch

import schedlang
from schedlang.report import collect, render
from schedlang.report.training import training_plan


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      vocab_size=256, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def test_a_schedule_gets_the_plan_block_of_its_layout():
    sch = schedlang.create_schedule(_llama())
    plain = training_plan(sch, global_batch=4, seq=64)
    for i in range(2):
        sch[f"model.layers.{i}"].checkpoint()
    checkpointed = training_plan(sch, global_batch=4, seq=64)
    assert "layout      pp=1 dp=1 tp=1 (activation checkpointing)" in checkpointed["text"]
    assert "global batch 4 x 64 tokens" in checkpointed["text"] and "per rank    params" in checkpointed["text"]
    assert checkpointed["estimate"]["activation_bytes"] < plain["estimate"]["activation_bytes"]
    page = render(collect(sch, training={"global_batch": 4, "seq": 64}))
    assert 'id="training"' in page and "schedlang train --dry-run" in page and "per rank" in page


def test_a_model_without_decoder_layers_gets_a_note():
    sch = schedlang.create_schedule(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert training_plan(sch) is None
    assert "No training estimate: the model is no decoder-only transformer" in render(collect(sch))
