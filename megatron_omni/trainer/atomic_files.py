"""Whole-or-nothing writes of the trainer's run-folder files (config, metrics and eval logs, figures, eval
results): each is written to a temporary name beside its target and renamed over it, so a reader, or a run
killed mid-write, sees the old file or the new one and never a half-written one. On any failure the
temporary file is removed and the error propagates."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path` (ending in `suffix`, for writers that pick the format by the
    name); when the block exits normally it is renamed to `path`, otherwise removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """Replace `path`'s contents with `text`, atomically."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Replace `path` with one JSON object per line, atomically."""
    write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> None:
    """Save a matplotlib figure to `path` (a .png), atomically, and close it."""
    import matplotlib.pyplot as plt

    try:
        with replacing(path, suffix=Path(path).suffix) as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
