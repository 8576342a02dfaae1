"""Searching a space of schedule configurations with a real runner.

A *runner* measures one configuration: ``runner(config) -> throughput`` (higher is better; e.g.
samples per second over a few training steps). A point that runs out of memory (``torch.OutOfMemoryError``,
``MemoryError``, or a runner that returns ``None`` / ``0``) is a failed point with throughput 0;
other exceptions propagate. Results are cached in a :class:`~schedlang.autotune.database.Database`
(a JSON file), so an interrupted search resumes without rerunning what it measured.

* :func:`grid_search` runs every configuration in order (Slapo's exhaustive search), stopping
  early after ``patience`` measurements without improvement.
* :func:`model_guided_search` first *prunes* with a cost model: ``estimate_memory(config)``
  (bytes per device) drops configurations that cannot fit ``memory_limit``; then it *orders* the
  rest by ``estimate_time(config)`` (predicted seconds per sample, e.g. FLOPs over the device's
  speed, plus recomputation and communication) and measures the most promising first, stopping
  after ``patience`` measurements without improvement. With a cost model that ranks well, the
  best configuration is measured within the first few trials.

:func:`transformer_cost_model` gives both estimates for a decoder-only transformer from its
sizes and the knobs ``batch_size``, ``ckpt_ratio``, ``tp``, ``dp``, ``pp``, ``fuse``.
Every search returns a :class:`TuneResult` whose :meth:`~TuneResult.best_so_far` is the curve to
print or plot (:func:`plot_best_so_far`).

Example::

    result = model_guided_search(configs, runner, estimate_memory=mem, estimate_time=t,
                                 memory_limit=80e9, db=Database("tune.json"))
    print(result.best_config, result.best_value, len(result.trials))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..errors import ScheduleValueError
from ..logger import get_logger
from .database import Database, config_key

__all__ = ["TuneResult", "measure", "grid_search", "model_guided_search", "transformer_cost_model",
           "plot_best_so_far", "is_out_of_memory"]

logger = get_logger("schedlang.autotune")

Config = Dict[str, Any]


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(error, MemoryError) or (bool(oom) and isinstance(error, oom)) or \
        "out of memory" in str(error).lower()


@dataclasses.dataclass
class TuneResult:
    """What a search measured, in order: ``trials`` holds ``(config, throughput)`` (0.0: failed);
    ``pruned`` the configurations the cost model ruled out without running them."""

    trials: List[Tuple[Config, float]]
    pruned: List[Config] = dataclasses.field(default_factory=list)

    @property
    def best_config(self) -> Optional[Config]:
        best = max(self.trials, key=lambda t: t[1], default=None)
        return None if best is None or best[1] <= 0 else best[0]

    @property
    def best_value(self) -> float:
        return max((v for _, v in self.trials), default=0.0)

    def best_so_far(self) -> List[float]:
        """The best throughput after each trial."""
        curve, best = [], 0.0
        for _, value in self.trials:
            best = max(best, value)
            curve.append(best)
        return curve

    def trials_to_reach(self, value: float) -> Optional[int]:
        """How many trials it took to first measure ``value`` (or better); None if never."""
        for i, v in enumerate(self.best_so_far()):
            if v >= value:
                return i + 1
        return None


def measure(config: Config, runner: Callable[[Config], Optional[float]], db: Optional[Database] = None) -> float:
    """Throughput of ``config`` (cached in ``db``); 0.0 for a point that ran out of memory."""
    key = config_key(config)
    if db is not None and key in db:
        return float(db.get(key)["throughput"])
    try:
        value = runner(dict(config))
        value = 0.0 if value is None else float(value)
        status = "ok" if value > 0 else "failed"
    except Exception as e:  # out-of-memory is a failed point; anything else is a bug to surface
        if not is_out_of_memory(e):
            raise
        value, status = 0.0, "oom"
    logger.info("  %s -> %.3f (%s)", config, value, status)
    if db is not None:
        db.commit(key, {"config": config, "throughput": value, "status": status})
    return value


def _search(ordered: Iterable[Config], runner, db, patience: Optional[int], pruned=None) -> TuneResult:
    result = TuneResult([], list(pruned or []))
    since_best = 0
    for config in ordered:
        value = measure(config, runner, db)
        improved = value > result.best_value
        result.trials.append((config, value))
        since_best = 0 if improved else since_best + 1
        if patience is not None and since_best >= patience:
            logger.info("early stop: %d trials without improvement", patience)
            break
    return result


def grid_search(configs: List[Config], runner, db: Optional[Database] = None,
                patience: Optional[int] = None) -> TuneResult:
    """Measure every configuration in the given order (until ``patience`` trials without improvement)."""
    return _search(configs, runner, db, patience)


def model_guided_search(configs: List[Config], runner, estimate_memory: Optional[Callable[[Config], float]] = None,
                        estimate_time: Optional[Callable[[Config], float]] = None,
                        memory_limit: Optional[float] = None, db: Optional[Database] = None,
                        patience: Optional[int] = 3) -> TuneResult:
    """Prune by estimated memory, then measure in order of estimated time per sample (fastest first)."""
    if memory_limit is not None and estimate_memory is None:
        raise ScheduleValueError("model_guided_search: memory_limit needs estimate_memory")
    kept, pruned = [], []
    for config in configs:
        if memory_limit is not None and estimate_memory(config) > memory_limit:
            pruned.append(config)
        else:
            kept.append(config)
    logger.info("cost model: %d of %d configurations fit; measuring the most promising first", len(kept),
                len(configs))
    if estimate_time is not None:
        kept.sort(key=estimate_time)
    return _search(kept, runner, db, patience, pruned)


def transformer_cost_model(n_layers: int, hidden: int, seq_len: int, vocab: int, device_memory: float,
                           device_flops: float = 1e14, link_bytes_per_s: float = 1e11, bytes_per_param: int = 16,
                           activation_bytes: int = 2) -> Tuple[Callable[[Config], float], Callable[[Config], float]]:
    """``(estimate_memory, estimate_time)`` for a decoder of ``n_layers`` x ``hidden``.

    Memory per device: parameters with gradients and Adam state (``bytes_per_param`` each,
    ``12 L h^2 + V h`` parameters) split over ``tp * pp`` and, for the state, ``dp``; activations
    ``~34 s b h`` bytes per layer (16-bit), split by ``tp``, for ``L / pp`` layers, of which the
    checkpointed fraction keeps only its input (``2 s b h``). Time per sample: ``6 * params``
    FLOPs per token, plus a recomputed forward (``2 * params``) for the checkpointed fraction,
    over ``tp * pp * dp`` devices at ``device_flops``, plus tensor-parallel all-reduces of the
    activations (4 per layer) over ``link_bytes_per_s``; ``fuse`` saves 5 percent.
    ``device_memory`` is returned for convenience as the limit to prune with.
    """
    params = 12 * n_layers * hidden ** 2 + vocab * hidden

    def knobs(c: Config):
        return (c.get("batch_size", 1), c.get("ckpt_ratio", 0.0), c.get("tp", 1), c.get("dp", 1), c.get("pp", 1),
                bool(c.get("fuse", False)))

    def estimate_memory(c: Config) -> float:
        b, ratio, tp, dp, pp, _ = knobs(c)
        layers = math.ceil(n_layers / pp)
        state = params / (tp * pp) * (4 + (bytes_per_param - 4) / dp)
        per_layer = seq_len * b * hidden * activation_bytes
        acts = layers * per_layer * ((1 - ratio) * 17 / tp + ratio * 1)
        return state + acts

    def estimate_time(c: Config) -> float:
        b, ratio, tp, dp, pp, fuse = knobs(c)
        tokens = b * seq_len
        flops = tokens * params * (6 + 2 * ratio)
        compute = flops / (device_flops * tp * pp * dp)
        comm = 0.0 if tp == 1 else 4 * n_layers / pp * tokens * hidden * activation_bytes * 2 * (tp - 1) / tp \
            / link_bytes_per_s
        return (compute * (0.95 if fuse else 1.0) + comm) / b  # seconds per sample

    estimate_memory.device_memory = device_memory
    return estimate_memory, estimate_time


def plot_best_so_far(results: Dict[str, TuneResult], path: Optional[str] = None) -> str:
    """The best-so-far curves of several searches as a text table; with ``path`` and matplotlib
    installed, also a PNG plot there. Returns the table."""
    width = max(len(r.trials) for r in results.values())
    lines = ["trial " + " ".join(f"{name:>14}" for name in results)]
    curves = {name: r.best_so_far() for name, r in results.items()}
    for i in range(width):
        cells = [f"{curves[n][i]:14.3f}" if i < len(curves[n]) else " " * 14 for n in results]
        lines.append(f"{i + 1:5d} " + " ".join(cells))
    table = "\n".join(lines)
    if path is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.info("matplotlib is not installed; only the table is returned")
        else:
            fig, ax = plt.subplots(figsize=(6, 4))
            for name, curve in curves.items():
                ax.plot(range(1, len(curve) + 1), curve, marker="o", label=name)
            ax.set_xlabel("trial")
            ax.set_ylabel("best throughput so far")
            ax.legend()
            fig.savefig(path, bbox_inches="tight")
            plt.close(fig)
    return table
