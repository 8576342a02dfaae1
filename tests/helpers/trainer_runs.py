"""Trainer runs compared step by step: run ``schedlang train`` in this process with a metrics file and read
its records back; check that two runs' losses and gradient norms agree at every step they share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from schedlang import train as trainer

__all__ = ["run_metrics", "assert_same_steps"]


def run_metrics(flags: Sequence[str], metrics: Path) -> List[Dict]:
    """Train with ``flags`` writing one JSON line per step to ``metrics`` (appended to); the records, in order."""
    assert trainer.main(list(flags) + ["--metrics", str(metrics)]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def assert_same_steps(records: List[Dict], reference: List[Dict], loss_tol: float = 1e-5,
                      grad_tol: float = 1e-4) -> None:
    """``records`` cover some of ``reference``'s steps (a resumed run: the last ones), with the same losses
    (``loss_tol``, relative and absolute) and gradient norms (``grad_tol`` relative, 1e-5 absolute)."""
    steps = [r["step"] for r in records]
    ref = [r for r in reference if r["step"] in steps]
    assert steps and steps == [r["step"] for r in ref], (steps, [r["step"] for r in reference])
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor([r["loss"] for r in ref]),
                               rtol=loss_tol, atol=loss_tol)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records]),
                               torch.tensor([r["grad_norm"] for r in ref]), rtol=grad_tol, atol=1e-5)
