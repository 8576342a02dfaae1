"""The ``schedlang-train-default`` row of ``bench/bench_train.py``: the trainer's default path, as
``torchrun --nproc_per_node=2 -m schedlang.train --config 1b --global-batch 8 --seq 2048`` runs it.

The flags are parsed and resolved by the trainer itself (on a GPU: bf16, per-layer compile,
optimize_model, FusedAdamW; on several ranks ``--layout auto`` with the link measured), the model is
built by the trainer's ``_Run`` and every step after the first is the trainer's own step (the global
gradient norm, learning rate, the loss averaged over the ranks), so the row times what users run. Three
things are the harness's: the model's config is the work's (written to a config.json the trainer reads),
the weights are the work's HF initialization from seed 0, loaded into the built model, and the
optimizer's numbers are the harness's (weight decay, betas, no clipping) and the layout has no pipeline
stages (``--layout auto`` chooses among the layouts of one stage: a pipeline's step gives no loss to check on
every rank), so that the row passes the
same loss and gradient-direction checks as the others (the trainer's own initialization draws the
same distribution in another order). The learning rate is the run's
(``--lr``) and constant, as the other rows'.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

import baselines as B  # noqa: E402  (bench/baselines.py)


def make_trainer_default(ctx: B.Context, cfg, global_batch: int, seq: int) -> B.Setup:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from schedlang.train.flags import build_parser, validate
    from schedlang.train.layout import (apply_layout, check_model_layout, choice_block, choose, fixed_choices,
                                        hardware, measure_link, model_facts)
    from schedlang.train.run import _Run

    if ctx.cuda and ctx.args.optimizer != "schedlang-fused":
        # on a GPU the trainer steps with schedlang's FusedAdamW: like for like only when every row does
        raise B.NotAvailable("the trainer's default optimizer on a GPU is schedlang's FusedAdamW: run with "
                             "--optimizer schedlang-fused so that every row uses it")
    world = ctx.world
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with tempfile.TemporaryDirectory() as directory:
        config = Path(directory) / "config.json"
        config.write_text(json.dumps(cfg.to_diff_dict() | {"model_type": cfg.model_type}))
        # the optimizer's numbers are the harness's (weight decay 0.01, no clipping; betas below), so that the
        # loss check compares like for like; the trainer still computes the global gradient norm every step
        argv = ["--config", str(config), "--global-batch", str(global_batch), "--seq", str(seq), "--lr", str(ctx.lr),
                "--lr-schedule", "constant", "--steps", "1000000", "--device", ctx.device.type,
                "--weight-decay", "0.01", "--grad-clip", "0"]
        ns = build_parser().parse_args(argv)
        validate(ns, world)
        facts = model_facts(ns, check_tensor_parallel=world > 1)
        reason = None
        if ns.layout == "auto":
            # the harness's first step is checked against the eager model's loss, which a pipeline's step cannot
            # give: the layout is chosen among those without stages (on a loaded CPU host the measured link is
            # slow enough for the planner to prefer two stages of a tiny model)
            ns._auto_fixed = dict(fixed_choices(ns), pp=1)
            link = measure_link(ctx.device, world) if world > 1 and ns.link_gbps is None else None
            choice = choose(ns, facts, hardware(ns, world, link), world)
            apply_layout(ns, choice.best.layout, world)
            reason = choice_block(choice)
            if rank == 0:
                print(reason, flush=True)
        check_model_layout(ns, facts)
        run = _Run(ns, rank, world, ctx.device)
        run.make_mesh()
        run.build()
    for group in run.optimizer.param_groups:  # the harness's AdamW betas (the trainer's default is (0.9, 0.95))
        group["betas"] = (0.9, 0.999)
    reference = B.full_model(cfg, ctx.device).state_dict()
    result = set_model_state_dict(run.model, reference, options=StateDictOptions(full_state_dict=True, strict=False))
    missing = [k for k in getattr(result, "missing_keys", []) if not k.endswith("rotary_emb.inv_freq")]
    if missing:
        raise RuntimeError(f"the work's weights do not cover the trainer's model: {missing[:5]}")
    del reference
    steps = {"n": 1}

    def trainer_step(ids, labels):
        steps["n"] += 1
        return run.train_step(steps["n"], ids, labels)["loss"]

    notes = {"loss": "the trainer's (fused linear + cross entropy with optimize_model)" if run.fused_loss
             else "the trainer's", "trainer": f"schedlang.train --global-batch {global_batch} --seq {seq} (defaults) -> {run.layout()}",
             "trainer_flags": {k: getattr(ns, k) for k in ("dtype", "compile", "optimize", "optimizer", "dp_mode",
                                                           "no_reshard", "reduce_dtype", "activation_checkpoint")},
             "layout_choice": reason, "compile": "layers" if ns.compile else None,
             "weights": "the work's HF initialization, loaded into the trainer's model",
             "optimizer_numbers": "the harness's: weight decay 0.01, betas (0.9, 0.999), no clipping (the gradient "
                                  "norm is still computed and all-reduced each step)"}
    return B.Setup(run.model, run.optimizer, run.forward_loss, dp=ns.dp, tp=ns.tp, dp_rank=run.dp_rank,
                   notes=notes, step=trainer_step)
