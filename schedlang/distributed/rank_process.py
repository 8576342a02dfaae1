"""One rank started by :mod:`schedlang.distributed.launch`: the child process's side.

The launcher starts every rank as ``python -c BOOTSTRAP spec.json``, not through ``multiprocessing``:
a spawned ``multiprocessing`` child re-runs the parent's main script (or, when the script was executed
by Sphinx-gallery under a stand-in ``__main__``, cannot find its functions at all). Here the child
imports nothing of the parent but the function to run:

* a function of an importable module is unpickled by reference, with the parent's ``sys.path``;
* a function of the parent's main script (``__main__``) is found by its file: the child runs the
  file's *definitions* only (imports, functions, classes and UPPER_CASE constants) under the name
  ``__main__``, so the script's other module-level code (the cells that launch ranks, plot, print)
  runs in the parent alone.

The launcher writes each function to run as ``job-<n>.pkl`` in the run's directory; the rank runs it and
writes its outcome, ``(ok, value_or_traceback)``, to ``result-<n>-<rank>.pkl`` (both renamed into place,
so no side reads half a file). Ranks kept by :func:`~schedlang.distributed.launch.launch` then wait for
the next job, on the same process group; they leave when the launcher's directory or process is gone.
Their stdout and stderr are files that the launcher passes on as they grow. A rank that cannot load the
function prints why on stderr and exits with code 1 without a result, like a rank that dies.
"""

from __future__ import annotations

import ast
import os
import pickle
import sys
import time
import traceback
import types
from typing import Any, Callable, Optional, Tuple

# what the child runs: only json and sys until the parent's sys.path is in place
BOOTSTRAP = ("import json, sys; spec = json.load(open(sys.argv[1])); sys.path[:] = spec['sys_path']; "
             "from schedlang.distributed.rank_process import rank_main; rank_main(spec)")
# set in every rank this launcher starts: a launch from inside one is refused, not taken for torchrun
LAUNCHED_RANK_ENV = "SCHEDLANG_LAUNCHED_RANK"


def job_path(run_dir: str, job: int) -> str:
    return os.path.join(run_dir, f"job-{job}.pkl")


def result_path(run_dir: str, rank: int, job: int) -> str:
    return os.path.join(run_dir, f"result-{job}-{rank}.pkl")


def _is_definition(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names = []
    for target in targets:
        names += target.elts if isinstance(target, ast.Tuple) else [target]
    # an UPPER_CASE name is a constant by convention; anything else may be the result of work
    return bool(names) and all(isinstance(n, ast.Name) and n.id.isupper() for n in names)


def run_definitions(path: str) -> types.ModuleType:
    """A module named ``__main__`` holding what the file at ``path`` defines (see the module docstring);
    classes defined there pickle as ``__main__.<name>``, which the launching script's main module also
    defines."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    kept = ast.Module(body=[node for node in tree.body if _is_definition(node)], type_ignores=[])
    module = types.ModuleType("__main__")
    module.__file__ = path
    try:
        exec(compile(kept, path, "exec"), module.__dict__)
    except Exception as e:
        raise RuntimeError(f"running the definitions of {path} (its imports, functions, classes and UPPER_CASE "
                           f"constants; the rest of the file runs only in the launching process) failed: "
                           f"{type(e).__name__}: {e}") from e
    return module


def find_definition(module: types.ModuleType, qualname: str) -> Any:
    found: Any = module
    for part in qualname.split("."):
        if not hasattr(found, part):
            raise RuntimeError(f"{module.__file__} defines no {qualname!r} at module level once its definitions "
                               "have run")
        found = getattr(found, part)
    return found


_loaded_files: dict = {}  # path -> the module of its definitions: a rank loads a script once for all its jobs


def _load_work(path: str) -> Tuple[Callable, tuple]:
    with open(path, "rb") as f:
        how, where, args_blob = pickle.load(f)
    if how == "file":
        file, qualname = where
        if file not in _loaded_files:
            _loaded_files[file] = run_definitions(file)
        sys.modules["__main__"] = _loaded_files[file]
        fn = find_definition(_loaded_files[file], qualname)
    elif how == "module":
        import importlib

        module_name, qualname = where
        fn = find_definition(importlib.import_module(module_name), qualname)
    else:
        fn = pickle.loads(where)
    return fn, pickle.loads(args_blob)


def _write_result(spec: dict, rank: int, job: int, ok: bool, value: Any) -> None:
    target = result_path(spec["run_dir"], rank, job)
    try:
        blob = pickle.dumps((ok, value))
    except Exception:
        blob = pickle.dumps((False, f"the value rank {rank} returned cannot be sent back to the launching "
                                    f"process:\n{traceback.format_exc()}"))
    with open(target + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(target + ".tmp", target)


def _next_job(spec: dict, job: int) -> Optional[str]:
    """The path of job ``job`` once the launcher has written it; None once the launcher is gone."""
    path = job_path(spec["run_dir"], job)
    while not os.path.exists(path):
        if os.getppid() != spec["parent_pid"] or not os.path.isdir(spec["run_dir"]):
            return None
        time.sleep(0.05)
    return path


def rank_main(spec: dict) -> None:
    from ..quiet_imports import quiet_torchao_import

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # a rank imports transformers (and with it torchao) afresh: keep that import's noise out of what it prints
    quiet_torchao_import()
    import torch
    import torch.distributed as dist

    from .groups import pg_timeout

    job = 0
    try:
        while True:
            path = _next_job(spec, job)
            if path is None:
                return
            try:
                fn, args = _load_work(path)
            except BaseException:
                # no result: the launcher reports the exit code and this end of stderr, as for a rank that dies
                print(f"rank {rank} could not load the function to run:\n{traceback.format_exc()}", file=sys.stderr,
                      flush=True)
                sys.exit(1)
            try:
                if not dist.is_initialized():
                    if "nccl" in spec["backend"]:
                        torch.cuda.set_device(rank)
                    dist.init_process_group(spec["backend"], init_method=f"file://{spec['init_file']}", rank=rank,
                                            world_size=world, timeout=pg_timeout(spec["collective_timeout"]))
                value = fn(rank, world, *args)
                sys.stdout.flush()
                _write_result(spec, rank, job, True, value)
            except BaseException:  # report everything, including assertion failures, to the parent
                _write_result(spec, rank, job, False, traceback.format_exc())
                return
            if not spec["persistent"]:
                return
            job += 1
    finally:
        # destroying the groups closes this rank's connections: a peer blocked on it fails at once
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
