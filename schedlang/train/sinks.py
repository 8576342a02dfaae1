"""Where a run's metrics go: the metrics JSONL, TensorBoard scalars (``--tensorboard``) and, at the end,
a plot of the loss and throughput curves (``--plot``). Only rank 0 writes."""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Optional

logger = logging.getLogger("schedlang.train")

#: metric -> TensorBoard tag
TENSORBOARD_TAGS = {"loss": "train/loss", "eval_loss": "eval/loss", "tokens_per_s": "perf/tokens_per_s",
                    "mfu": "perf/mfu", "mem_gib": "memory/peak_gib", "lr": "train/lr", "grad_norm": "train/grad_norm",
                    "tokens_per_expert_min": "experts/tokens_min", "tokens_per_expert_max": "experts/tokens_max"}


class Sinks:
    """The outputs of rank 0: ``write(record)`` per step (or evaluation), ``close(history)`` at the end."""

    def __init__(self, ns, is_main: bool, resumed_at: Optional[int] = None):
        from .resume import open_metrics

        self.ns = ns
        # a resumed run keeps the records up to its checkpoint's step (see open_metrics)
        self.metrics = open_metrics(ns.metrics, resumed_at) if (ns.metrics and is_main) else None
        self.board = None
        if ns.tensorboard and is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir=ns.tensorboard)

    def write(self, record: Dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.board is not None:
            for key, tag in TENSORBOARD_TAGS.items():
                value = record.get(key)
                if isinstance(value, (int, float)):
                    self.board.add_scalar(tag, value, record["step"])

    def close(self, history: Optional[List[Dict[str, Any]]] = None) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.board is not None:
            self.board.flush()
            self.board.close()
            self.board = None
        if history is not None and self.ns.plot:
            plot_curves(history, self.ns.plot)


def plot_curves(history: List[Dict[str, Any]], path: str) -> str:
    """Loss (and eval loss) and tokens/s against the step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in history if "loss" in r]
    evals = [r for r in history if r.get("eval_loss") is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss")
    if evals:
        top.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], marker="o", label="eval loss")
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot([r["step"] for r in steps], [r["tokens_per_s"] for r in steps], color="tab:green")
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logger.info("wrote the loss and throughput curves to %s", path)
    return path
