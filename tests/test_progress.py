import io
import os
import subprocess
import sys
import time

import pytest

from schedlang.progress import Progress


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(time, "monotonic", c)
    return c


def test_quick_work_shows_nothing(clock, monkeypatch):
    monkeypatch.delenv("SCHEDLANG_PROGRESS", raising=False)
    out = io.StringIO()  # not a terminal: lines mode
    with Progress("replaying", total=3, stream=out) as bar:
        for _ in range(3):
            clock.now += 0.1
            bar.update(note="shard")
    assert out.getvalue() == ""


def test_long_work_prints_rate_limited_lines_off_a_terminal(clock, monkeypatch):
    monkeypatch.delenv("SCHEDLANG_PROGRESS", raising=False)
    out = io.StringIO()
    with Progress("verifying", total=10, unit="phase", stream=out, every_seconds=10) as bar:
        for k in range(10):
            clock.now += 3.0
            bar.update(note=f"phase {k}")
    lines = out.getvalue().splitlines()
    # first line once past 2 s, then one per 10 s at most, then the closing line
    assert lines[0] == "schedlang: verifying: 1/10 phases (phase 0) … [3.0 s]"
    assert lines[-1] == "schedlang: verifying: 10/10 phases done [30.0 s]"
    assert 3 <= len(lines) <= 5


def test_switched_off(clock, monkeypatch):
    monkeypatch.setenv("SCHEDLANG_PROGRESS", "0")
    out = io.StringIO()
    with Progress("x", total=2, stream=out) as bar:
        clock.now += 50
        bar.update()
    assert out.getvalue() == ""


def test_a_failure_leaves_no_closing_line(clock, monkeypatch):
    monkeypatch.setenv("SCHEDLANG_PROGRESS", "lines")
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("x", total=2, stream=out) as bar:
            clock.now += 5
            bar.update()
            raise RuntimeError("boom")
    assert "done" not in out.getvalue() and "1/2" in out.getvalue()


def test_a_terminal_gets_a_bar():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    with Progress("x", total=2, stream=out, min_seconds=0) as bar:
        assert bar.mode == "bar"
        bar.update()
        bar.update()
        assert bar._bar.n == 2
    text = out.getvalue()
    assert text.startswith("\rx:") and "/2 [" in text and text.endswith("\r")  # drawn, then cleared (leave=False)


def test_torch_logs_turns_on_schedlang_debug_logging():
    code = ("import logging, schedlang; logging.getLogger('schedlang.schedule').debug('probe-debug'); "
            "logging.getLogger('schedlang.schedule').info('probe-info')")
    env = dict(os.environ, TORCH_LOGS="+schedlang")
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "probe-debug" in on.stderr and "probe-info" in on.stderr
    env["TORCH_LOGS"] = ""
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "probe" not in off.stderr
