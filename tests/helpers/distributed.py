"""Multi-process test helper: spawn ranks from inside a test, fail on timeout instead of hanging.

``run_distributed(fn, world_size=2, timeout=...)`` runs ``fn(rank, world)`` on fresh processes sharing one
process group (gloo, or ``cpu:gloo,cuda:nccl`` with a GPU per rank, so CPU tensors keep working on GPU
machines). The groups' timeout is ``collective_timeout`` (default: the smaller of 120 s and 80% of
``timeout``); a failed rank stops the others within a few seconds and the error names it.
"""

from schedlang.distributed.launch import run_distributed

__all__ = ["run_distributed"]
