"""Slapo's ``get_logger``: a logger under ``schedlang`` that can log on chosen ranks only.

Slapo's loggers printed to stdout themselves. Here the library configures nothing: the logger
is ``logging.getLogger("schedlang.<name>")`` (so ``TORCH_LOGS=+schedlang`` and the application's
own handlers apply), wrapped so that ``logger.info(msg, ranks=0)`` logs on rank 0 only and each
message carries the rank prefix when torch.distributed is running.

Example::

    logger = get_logger("train")
    logger.info("loss %.3f", loss, ranks=[0])
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch.distributed as dist

__all__ = ["get_logger", "CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET"]

CRITICAL, FATAL, ERROR = logging.CRITICAL, logging.FATAL, logging.ERROR
WARNING, WARN, INFO, DEBUG, NOTSET = logging.WARNING, logging.WARN, logging.INFO, logging.DEBUG, logging.NOTSET

_LOGGERS: Dict[str, "RankLogger"] = {}


class RankLogger(logging.LoggerAdapter):
    """A logger whose calls also take ``ranks=`` (an int or a list) and ``group=``."""

    def log(self, level, msg, *args, **kwargs):  # every info/warning/... call ends here
        ranks = kwargs.pop("ranks", None)
        group = kwargs.pop("group", None)
        if dist.is_available() and dist.is_initialized():
            me = dist.get_rank(group)
            if ranks is not None and me not in (set(ranks) if isinstance(ranks, (list, tuple, set)) else {ranks}):
                return
            msg = f"[Rank {me}] {msg}"
        if self.isEnabledFor(level):
            kwargs.setdefault("stacklevel", 3)
            self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str = "schedlang", level: Optional[int] = None) -> RankLogger:
    """The logger ``schedlang.<name>`` (``name`` as is when it already starts with ``schedlang``).

    ``level`` sets that logger's level; without it the level is inherited. No handler is added:
    configure logging in the application (``logging.basicConfig(level=logging.INFO)``).
    """
    full = name if name == "schedlang" or name.startswith("schedlang.") else f"schedlang.{name}"
    adapter = _LOGGERS.get(full)
    if adapter is None:
        adapter = _LOGGERS[full] = RankLogger(logging.getLogger(full), {})
    if level is not None:
        adapter.logger.setLevel(level)
    return adapter
