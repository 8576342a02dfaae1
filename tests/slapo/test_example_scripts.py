"""The model set-up of Slapo's Megatron example scripts (OPT, GPT-Neo), with only the import changed,
on tiny configs on the CPU (one rank): a model built under ``init_empty_weights``, scheduled by
``apply_schedule`` with the scripts' options (the schedule key positional or as ``schedule_key=``,
``model_config``, ``attn_op_name``, ``fp16``, ``ckpt_ratio``, ``delay_init``), built with the
model's own ``_init_weights``, then seeded with ``set_random_seed``.

The built model must hold weights the model's init produced (not the meta placeholders) and compute
what the unscheduled HF model computes with those weights, forward and backward, in half precision.
"""

import pytest
import torch

import schedlang as slapo
from schedlang.model_schedule import apply_schedule
from schedlang.utils.report import report_memory


def _opt():
    import transformers as tf

    config = tf.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                          max_position_embeddings=16, word_embed_proj_dim=32, vocab_size=96)
    return tf.OPTModel, config, config.init_std


def _gpt_neo():
    import transformers as tf

    config = tf.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=16, vocab_size=96,
                             attention_types=[[["global"], 2]], bos_token_id=0, eos_token_id=0)
    config.attention_layers = ["global"] * config.num_layers   # as the GPT-Neo script sets it
    return tf.GPTNeoModel, config, config.initializer_range


def _as_script_does(family, model_class, config, key_as_keyword):
    """What the example's ``get_model`` does with ``impl="slapo"``, ``fp16=True``, ``delay_init=True``."""
    config.use_cache = False
    report_memory()
    with slapo.init_empty_weights(enable=True):
        model = model_class(config)
    report_memory()
    key = {"schedule_key": family} if key_as_keyword else {}
    sch = apply_schedule(model, *(() if key_as_keyword else (family,)), **key, model_config=config,
                         attn_op_name="cuda", fp16=True, ckpt_ratio=0.5, delay_init=True)
    built, _ = slapo.build(sch, init_weights=model._init_weights)
    slapo.set_random_seed(2013, None, None, sch.rank)
    return model, sch, built


@pytest.mark.parametrize("family, make, key_as_keyword", [("opt", _opt, False), ("gpt_neo", _gpt_neo, True)])
def test_an_example_scripts_schedule_runs_with_only_the_import_changed(family, make, key_as_keyword):
    model_class, config, init_std = make()
    model, sch, built = _as_script_does(family, model_class, config, key_as_keyword)
    assert next(model.parameters()).is_meta   # the script's model stays as it was: meta, unscheduled
    assert "checkpoint" in [step.primitive for step in sch.plan]   # ckpt_ratio=0.5 of 2 layers

    params = dict(built.named_parameters())
    assert all(p.dtype == torch.float16 and p.device.type == "cpu" for p in params.values())
    # the model's own init ran: Linear weights drawn with its std, LayerNorm weights one
    weights = torch.cat([p.detach().float().flatten() for n, p in params.items()
                         if n.endswith("fc1.weight") or n.endswith("c_fc.weight")])
    assert abs(weights.std().item() - init_std) < 0.2 * init_std
    assert all(p.eq(1).all() for n, p in params.items() if ("layer_norm" in n or ".ln_" in n) and n.endswith("weight"))

    # the unscheduled model with the built model's weights computes the same, forward and backward
    reference = model_class(config)
    reference.load_state_dict(built.state_dict())
    reference.half()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    cotangent = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(2)).half()
    outputs, grads = [], []
    for m in (built, reference):
        m.eval()
        out = m(input_ids=ids).last_hidden_state
        out.backward(cotangent)
        outputs.append(out.detach().float())
        grads.append(m.get_input_embeddings().weight.grad.float())
    assert torch.isfinite(outputs[0]).all()
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(grads[0], grads[1], atol=2e-3, rtol=2e-3)

    # set_random_seed(seed, dp_rank, pp_rank, tp_rank) makes the default stream reproducible
    slapo.set_random_seed(2013, None, None, sch.rank)
    first = torch.rand(4)
    slapo.set_random_seed(2013, None, None, sch.rank)
    torch.testing.assert_close(torch.rand(4), first, rtol=0, atol=0)
