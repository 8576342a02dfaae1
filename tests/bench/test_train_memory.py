"""bench/train_memory.py: the trainer's memory estimate against the measured peak, one row per layout."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def train_memory(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import train_memory

    return train_memory


def test_each_layout_row_carries_the_estimate_the_peak_and_their_error(train_memory, tmp_path):
    code = train_memory.main(["--tiny", "--nproc", "2", "--steps", "2", "--layouts", "fsdp,tp",
                              "--results-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("*-train-memory-tiny.json")
    data = json.loads(path.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"fsdp", "tp"}
    for name, row in rows.items():
        assert row["check"] == "ok" and row["work"] == "llama-tiny-memory", row
        assert row["measured_gib"] > 0 and row["estimated_gib"] > 0
        assert row["error"] == pytest.approx(row["measured_gib"] / row["estimated_gib"] - 1, rel=1e-2)
        assert any(line.startswith("layout ") for line in row["plan"]), row["plan"]
    assert "dp=2" in rows["fsdp"]["plan"][0] and "tp=2" in rows["tp"]["plan"][0]
    assert data["git_sha"] and data["torch"]


def test_unknown_layouts_are_refused_with_the_known_ones(train_memory, capsys):
    with pytest.raises(SystemExit):
        train_memory.main(["--tiny", "--layouts", "fsdp,zigzag"])
    assert "unknown ['zigzag']; known: auto, fsdp" in capsys.readouterr().err
