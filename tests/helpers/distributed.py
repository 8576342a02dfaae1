"""Multi-process test helper: spawn gloo ranks from inside a test, fail on timeout instead of hanging."""

from schedlang.distributed.launch import run_distributed

__all__ = ["run_distributed"]
