"""The tuner as a command: ``schedlang tune --config cfg.py [--db tune.json] script.py ARGS...``
(also ``python -m schedlang.autotune.tune``), with Slapo's names.

The config file defines the space, one of:

* ``update_space(args, space)``: creates the symbols (``space.create_symbol("batch_size", [...])``),
  possibly depending on symbols already fixed, and returns the space;
* ``get_bs_range(args)`` (Slapo's form): ``(min_bs, max_bs, step)``; the space is then the batch
  sizes times checkpoint ratios.

and optionally the cost model: ``estimate_memory(config)``, ``estimate_time(config)`` and
``memory_limit``, which ``--strategy model`` (the default when they exist) uses to prune and order.
Each configuration is measured by running ``script.py`` with ``ARGS`` in which every symbol name
is replaced by its value (and the values also in the environment, ``NAME=value``); the script's
log gives the throughput (``samples/sec: X`` / ``SamplesPerSec=X``, or a DeepSpeed / Megatron log).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import ScheduleTypeError, ScheduleValueError
from ..logger import get_logger
from .database import Database
from .search import TuneResult, grid_search, model_guided_search, plot_best_so_far
from .space import Space, Symbol, must_fix

__all__ = ["must_fix", "Symbol", "Space", "Database", "parse_args", "convert_nargs_to_dict", "run_training_script",
           "tune", "load_config", "parse_log", "main", "CKPT_RATIOS"]

logger = get_logger("schedlang.autotune")

#: checkpoint ratios tried with ``get_bs_range`` configs
CKPT_RATIOS = [1.0, 0.84, 0.67, 0.5, 0.34, 0.25, 0.0]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser("schedlang tune", description="search schedule knobs by measured training steps")
    parser.add_argument("--config", required=True, help="python file defining update_space or get_bs_range")
    parser.add_argument("--db", help="JSON file caching the measurements (resumes an interrupted search)")
    parser.add_argument("--strategy", choices=["auto", "grid", "model"], default="auto",
                        help="grid: every point; model: prune and order by the config's cost model "
                             "(auto: model when the config defines one)")
    parser.add_argument("--patience", type=int, default=None, help="stop after this many trials without improvement")
    parser.add_argument("--error-stop", default="none", choices=["none", "symbol", "all"],
                        help="accepted for compatibility; out-of-memory points count as failed, other errors stop")
    parser.add_argument("--plot", help="write the best-so-far curve here (PNG, needs matplotlib)")
    parser.add_argument("training_script", help="the training script to run per configuration")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="its arguments (symbol names replaced)")
    return parser.parse_args(argv)


def _number(text: str):
    try:
        value = float(text)
    except ValueError:
        return text
    return int(value) if value.is_integer() and "." not in text else value


def convert_nargs_to_dict(nargs: Sequence[str]) -> Dict[str, Any]:
    """``["--gpus", "8", "--fp16", "model"]`` -> ``{"gpus": 8, "fp16": 1, "model": 1}``; several
    values after a flag make a list."""
    out: Dict[str, Any] = {}
    i = 0
    nargs = list(nargs or [])
    while i < len(nargs):
        is_flag, name = nargs[i].startswith("-"), nargs[i].lstrip("-")
        i += 1
        values = []
        while is_flag and i < len(nargs) and not nargs[i].startswith("-"):
            values.append(_number(nargs[i]))
            i += 1
        out[name] = 1 if not values else values[0] if len(values) == 1 else values
    return out


def run_training_script(args: argparse.Namespace, tuneable_cfg: Dict[str, Any],
                        log_file: str = "run_script.log", timeout: Optional[float] = None) -> str:
    """Run the training script with every symbol name in its arguments replaced by its value;
    returns the log file (stdout and stderr)."""
    script_args = []
    for arg in args.training_script_args:
        for key, value in tuneable_cfg.items():
            arg = re.sub(rf"\b{re.escape(key)}\b", str(value), arg)
        script_args.append(arg)
    env = dict(os.environ, **{k: str(v) for k, v in tuneable_cfg.items()})
    logger.info("running %s %s", args.training_script, " ".join(script_args))
    with open(log_file, "w", encoding="utf-8") as log:
        subprocess.run([sys.executable, args.training_script, *script_args], stdout=log, stderr=subprocess.STDOUT,
                       env=env, timeout=timeout, check=False)
    return log_file


def parse_log(args: Any, log_file: str) -> float:
    """Samples per second reported in ``log_file``; 0.0 for a run that failed or ran out of memory."""
    from ..framework_dialect import get_dialect_cls

    with open(log_file, encoding="utf-8") as f:
        text = f.read()
    names = args if isinstance(args, dict) else convert_nargs_to_dict(getattr(args, "training_script_args", []))
    for target in ("megatron", "deepspeed"):
        if any(target in str(k) for k in names):
            code, throughput, _, _ = get_dialect_cls("log_parser", target).parse_log(text)
            return 0.0 if code else throughput
    if "out of memory" in text.lower() or "Traceback (most recent call last)" in text:
        return 0.0
    found = re.findall(r"(?:samples/sec|samples_per_sec|SamplesPerSec|throughput)\s*[:=]\s*([0-9.]+)", text)
    return float(found[-1]) if found else 0.0


def load_config(config_file: str):
    """Import the config file as a module."""
    if not os.path.exists(config_file):
        raise ScheduleValueError(f"tune: config file {config_file!r} does not exist; pass the path of an existing "
                                 "config file")
    spec = importlib.util.spec_from_file_location("schedlang_tune_config", config_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not (hasattr(module, "update_space") or hasattr(module, "get_bs_range")):
        raise ScheduleTypeError(f"tune: {config_file} defines neither update_space(args, space) nor "
                                "get_bs_range(args)")
    return module


def _configs_of(module, script_args: Dict[str, Any]) -> List[Dict[str, Any]]:
    if hasattr(module, "update_space"):
        return Space().enumerate(module.update_space, script_args)
    return _bs_ckpt_configs(module.get_bs_range, script_args)


def _bs_ckpt_configs(get_bs_range, script_args) -> List[Dict[str, Any]]:
    min_bs, max_bs, step = get_bs_range(script_args)
    return [{"batch_size": bs, "ckpt_ratio": r} for bs in range(max_bs, min_bs - 1, -step) for r in CKPT_RATIOS]


def tune(args: argparse.Namespace, get_bs_range: Callable, eval_fn: Callable[[Dict[str, Any]], float],
         patience: Optional[int] = 5) -> Optional[Dict[str, Any]]:
    """Slapo's search: batch sizes from ``get_bs_range`` (largest first) times checkpoint ratios
    (least recomputation last), measured by ``eval_fn``; returns the best configuration."""
    script_args = convert_nargs_to_dict(getattr(args, "training_script_args", []))
    db = Database(getattr(args, "db", None))
    return grid_search(_bs_ckpt_configs(get_bs_range, script_args), eval_fn, db, patience).best_config


def run(args: argparse.Namespace) -> TuneResult:
    module = load_config(args.config)
    script_args = convert_nargs_to_dict(args.training_script_args)
    configs = _configs_of(module, script_args)
    db = Database(args.db)

    def runner(config):
        return parse_log(script_args, run_training_script(args, config))

    strategy = args.strategy
    if strategy == "auto":
        strategy = "model" if hasattr(module, "estimate_time") or hasattr(module, "estimate_memory") else "grid"
    logger.info("tuning %d configurations (%s search)", len(configs), strategy)
    if strategy == "grid":
        return grid_search(configs, runner, db, args.patience)
    return model_guided_search(configs, runner, getattr(module, "estimate_memory", None),
                               getattr(module, "estimate_time", None), getattr(module, "memory_limit", None), db,
                               args.patience if args.patience is not None else 3)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(plot_best_so_far({args.strategy: result}, args.plot))
    print(f"best: {result.best_config} ({result.best_value:.3f} samples/s) after {len(result.trials)} trials, "
          f"{len(result.pruned)} pruned by the cost model")
    return 0 if result.best_config is not None else 1


if __name__ == "__main__":
    sys.exit(main())
