"""The run folder's whole-or-nothing writes: a failed write leaves the old file and no temporary file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_omni.trainer import atomic_files


def test_write_text_and_jsonl_replace_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    atomic_files.write_text(path, "old\n")
    atomic_files.write_jsonl(path, [{"step": 1}, {"step": 2, "r": 0.5}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1}, {"step": 2, "r": 0.5}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    atomic_files.write_text(path, "old\n")
    with pytest.raises(TypeError):
        atomic_files.write_jsonl(path, [{"step": 1}, {"bad": object()}])  # not JSON: fails before the rename
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_files.replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer died")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl"]


def test_save_figure_writes_a_png_and_closes_the_figure(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    atomic_files.save_figure(fig, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
    fig, _ = plt.subplots()
    with pytest.raises(FileNotFoundError):
        atomic_files.save_figure(fig, tmp_path / "missing" / "curve.png")
    assert not plt.fignum_exists(fig.number)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]
