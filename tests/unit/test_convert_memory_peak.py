"""benchmarks/convert_memory.py measures each conversion's peak RSS in a spawned child: the figure is the child's
own, not the benchmark process's (which holds the synthetic checkpoint it wrote): on Linux a (v)fork + exec
child's `ru_maxrss` starts at the parent's high-water mark."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELD = 512 * 2**20  # what the parent holds while the child runs, every page touched


def _report(result: mp.Queue) -> None:
    import convert_memory

    result.put(convert_memory.peak_rss())


def test_a_spawned_child_reports_its_own_peak_rss(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the spawned child inherits sys.path
    held = bytearray(HELD)
    held[::4096] = b"\x01" * len(range(0, HELD, 4096))
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    child = ctx.Process(target=_report, args=(result,))
    child.start()
    try:
        peak = result.get(timeout=300)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    del held
    # The child is an interpreter that imported pytest's entry module and the benchmark (no torch): well under
    # a quarter of what the parent holds; the parent's high-water mark is above HELD.
    assert 0 < peak < HELD // 4, f"the child reported {peak / 2**20:.0f} MiB"
