"""The trainer's outputs besides the metrics JSONL: TensorBoard scalars and the loss / throughput plot."""

from __future__ import annotations

import builtins

import pytest

from schedlang import train as trainer

COMMON = ["--config", "tiny", "--steps", "3", "--global-batch", "4", "--seq", "16", "--device", "cpu"]


def test_tensorboard_and_plot(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, plot = tmp_path / "tb", tmp_path / "curves.png"
    tokens = tmp_path / "held.npy"
    import numpy as np

    np.save(tokens, np.random.default_rng(0).integers(0, 256, size=400).astype(np.int32))
    assert trainer.main(COMMON + ["--tensorboard", str(board), "--plot", str(plot), "--eval-data", str(tokens),
                                  "--eval-every", "2"]) == 0
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "perf/tokens_per_s", "perf/mfu", "memory/peak_gib", "train/lr"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 3]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


def test_missing_tensorboard_and_matplotlib_are_named(tmp_path, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_extras(name, *args, **kwargs):
        if name in ("torch.utils.tensorboard", "matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_extras)
    assert trainer.main(COMMON + ["--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "--tensorboard needs the tensorboard package, which is not installed" in err
    assert "pip install 'schedlang[tensorboard]'" in err
    assert trainer.main(COMMON + ["--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot draws with matplotlib, which is not installed" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists() and not (tmp_path / "p.png").exists()
