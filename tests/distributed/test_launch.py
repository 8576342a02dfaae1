"""The local launcher: results by rank, ranks that die reported at once with their exit code and stderr,
and functions of a main script (run by python, or executed the way Sphinx-gallery does) found by file."""

import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch
import torch.distributed as dist

import schedlang
from schedlang.distributed.launch import launch, run_distributed
from schedlang.distributed.rank_process import find_definition, run_definitions

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sum_of_ranks(rank, world, scale):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank} of {world} says hello")
    return t.item() * scale


def test_results_come_back_by_rank_and_what_ranks_print_is_passed_on(capsys):
    assert run_distributed(_sum_of_ranks, world_size=2, args=(10,), timeout=120) == [30.0, 30.0]
    out = capsys.readouterr().out
    assert "rank 0 of 2 says hello" in out and "rank 1 of 2 says hello" in out


def _exits_with_3(rank, world):
    if rank == 1:
        print("rank 1 is about to leave", file=sys.stderr, flush=True)
        os._exit(3)
    time.sleep(60)  # blocked like a rank waiting on its dead peer: the launcher stops it


def test_a_rank_that_exits_is_reported_at_once_with_its_exit_code_and_stderr():
    start = time.monotonic()
    with pytest.raises(schedlang.DistributedError) as info:
        run_distributed(_exits_with_3, world_size=2, timeout=120)
    assert time.monotonic() - start < 30  # not the 120 s timeout: seconds after the exit
    assert str(info.value) == (
        "run_distributed: distributed run of _exits_with_3 on 2 ranks (gloo) failed:\n"
        "rank 1 failed first (exited with code 3 before reporting a result: rank 1 is about to leave)\n"
        "rank 1 failed:\n"
        "exited with code 3 before reporting a result; the end of its stderr:\n"
        "rank 1 is about to leave\n"
        "rank(s) [0] did not finish within 120 s (stopped 2 s after rank 1 failed)")


def test_a_function_the_ranks_cannot_load_is_reported_with_the_cause():
    # a module that exists in this process only: the function pickles by reference, and no rank can import it
    only_here = types.ModuleType("schedlang_module_only_in_the_parent")
    exec("def work(rank, world):\n    return rank\n", only_here.__dict__)
    sys.modules[only_here.__name__] = only_here
    try:
        start = time.monotonic()
        with pytest.raises(schedlang.DistributedError) as info:
            run_distributed(only_here.work, world_size=2, timeout=120)
    finally:
        del sys.modules[only_here.__name__]
    assert time.monotonic() - start < 30
    message = str(info.value)
    first_line = message.splitlines()[1]
    assert first_line in (
        f"rank {r} failed first (exited with code 1 before reporting a result: ModuleNotFoundError: "
        f"No module named 'schedlang_module_only_in_the_parent')" for r in (0, 1))
    assert f"rank {first_line[5]} could not load the function to run:\nTraceback" in message


def test_functions_that_cannot_reach_a_rank_are_refused_before_any_starts():
    def local(rank, world):
        return rank

    with pytest.raises(schedlang.ScheduleValueError, match=r"^run_distributed: the function to run on the ranks must "
                       r"be defined at module level \(the ranks find it by name\), got 'test_functions_that_cannot_reach"
                       r"_a_rank_are_refused_before_any_starts.<locals>.local'$"):
        run_distributed(local, world_size=2)
    with pytest.raises(schedlang.ScheduleValueError, match=r"^run_distributed: the arguments of _sum_of_ranks cannot "
                       r"be sent to the ranks \(.*\); pass plain values$"):
        run_distributed(_sum_of_ranks, world_size=2, args=(lambda: 1,))


def _pid_and_calls(rank, world):
    global _CALLS  # module state of the rank process: kept from one launch to the next
    _CALLS = globals().get("_CALLS", 0) + 1
    return os.getpid(), _CALLS, dist.get_world_size()


def test_launch_keeps_its_ranks_for_the_next_call_of_the_same_world_size():
    from schedlang.distributed import launch as launching

    try:
        first = launch(_pid_and_calls, world_size=2, timeout=120)
        second = launch(_pid_and_calls, world_size=2, timeout=120)
        assert [pid for pid, _, _ in first] == [pid for pid, _, _ in second]
        assert [calls for _, calls, _ in first] == [1, 1] and [calls for _, calls, _ in second] == [2, 2]
        third = launch(_pid_and_calls, world_size=3, timeout=120)  # another world: other processes
        assert [(calls, world) for _, calls, world in third] == [(1, 3)] * 3
        assert not set(pid for pid, _, _ in third) & set(pid for pid, _, _ in first)
    finally:
        launching._close_kept_ranks()


def test_launch_under_torchrun_refuses_another_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(schedlang.ScheduleValueError, match=r"^launch: _sum_of_ranks needs world_size=4 ranks, but "
                       r"torchrun started WORLD_SIZE=2; run torchrun with --nproc_per_node=4 \(or launch with "
                       r"world_size=2\)$"):
        launch(_sum_of_ranks, world_size=4)


def test_launch_inside_a_launched_rank_is_refused(monkeypatch):
    monkeypatch.setenv("SCHEDLANG_LAUNCHED_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(schedlang.ScheduleValueError, match=r"^launch: _sum_of_ranks was asked to start ranks from "
                       r"inside rank 1 of a launch; call launch from the launching process only"):
        launch(_sum_of_ranks, world_size=2)


def test_a_rank_runs_only_the_definitions_of_a_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import math
        SCALE, OFFSET = 3, math.floor(1.5)
        counter = []
        counter.append(1)          # work: not run in a rank
        raise_here = 1 / 0 if counter else None

        def work(rank, world):
            return SCALE * rank + OFFSET + helper()

        def helper():
            return len(counter) if "counter" in globals() else -1

        class Box:
            value = 7
    """))
    module = run_definitions(str(script))
    assert module.__name__ == "__main__" and sys.modules["__main__"] is not module
    assert find_definition(module, "work")(2, 4) == 3 * 2 + 1 - 1
    assert find_definition(module, "Box.value") == 7
    assert "counter" not in vars(module) and "raise_here" not in vars(module)
    with pytest.raises(RuntimeError, match=r"script.py defines no 'missing' at module level once its definitions have "
                                           r"run$"):
        find_definition(module, "missing")


SCRIPT = textwrap.dedent('''
    """A script that launches two ranks from its top level, as a tutorial does."""
    import sys

    import torch
    import torch.distributed as dist

    import schedlang

    FACTOR = 2


    def gather_ranks(rank, world):
        t = torch.tensor([float(rank)])
        parts = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(parts, t)
        if rank == 0:
            sys.stdout.write(f"rank 0 saw {[int(p.item()) for p in parts]}\\n")
            sys.stdout.flush()
        return FACTOR * (rank + 1)


    results = schedlang.launch(gather_ranks, world_size=2, timeout=120)
    # one write per line, newline included: under torchrun both ranks write into one pipe, and print
    # writes the text and its newline separately (two system calls when stdout is unbuffered), which
    # interleave between the ranks
    sys.stdout.write(f"results {results}\\n")
    sys.stdout.flush()
''')


def test_a_script_run_by_python_launches_its_own_functions(tmp_path):
    script = tmp_path / "launching_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["rank 0 saw [0, 1]", "results [2, 4]"]


def test_a_module_run_with_python_m_launches_its_own_functions_with_relative_imports(tmp_path):
    # ``python -m package.module``: the ranks import the module by its name, so its relative imports resolve
    package = tmp_path / "launching_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "constants.py").write_text("FACTOR = 2\n")
    (package / "main.py").write_text(SCRIPT.replace("FACTOR = 2", "from .constants import FACTOR").replace(
        "results = schedlang.launch", 'if __name__ == "__main__":\n    results = schedlang.launch').replace(
        "\nsys.stdout.write(", "\n    sys.stdout.write(").replace("\nsys.stdout.flush()", "\n    sys.stdout.flush()"))
    done = subprocess.run([sys.executable, "-m", "launching_package.main"], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["rank 0 saw [0, 1]", "results [2, 4]"]


def test_a_script_executed_like_sphinx_gallery_launches_its_own_functions(tmp_path):
    # Sphinx-gallery compiles each block with the file's name, runs it in a stand-in __main__ module
    # that has no __file__ and no path to import it by
    script = tmp_path / "gallery_script.py"
    script.write_text(SCRIPT)
    runner = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_loader("__main__", None)
        fake_main = importlib.util.module_from_spec(spec)
        fake_main.__dict__["__doc__"] = ""
        sys.modules["__main__"] = fake_main
        exec(compile(open({str(script)!r}).read(), {str(script)!r}, "exec"), fake_main.__dict__)
        assert "__file__" not in fake_main.__dict__
    """)
    done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["rank 0 saw [0, 1]", "results [2, 4]"]


def test_a_script_under_torchrun_runs_its_functions_on_torchrun_ranks(tmp_path):
    script = tmp_path / "torchrun_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # every rank gets every rank's result
    assert sorted(done.stdout.splitlines()) == ["rank 0 saw [0, 1]", "results [2, 4]", "results [2, 4]"]
