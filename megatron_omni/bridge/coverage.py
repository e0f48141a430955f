"""Every rollout parameter element written exactly once: a ledger of writes and its check.

A write is a `Region` (a slab `[start, stop)` along one dim, or the whole tensor). After a sync the ledger
holds what really happened (direct copies, or the slices a loader filled for the names it reported as
loaded), and `check()` compares it with the rollout module's real parameters. vLLM-Omni's `load_weights`
skips names it does not know without a word; this check is what turns that into an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from megatron_omni.bridge.plan import Region, SyncPlan


class CoverageError(RuntimeError):
    """Some rollout parameter was not written exactly once; the message names each one."""


class CoverageLedger:
    """Writes into the rollout parameters of one rollout rank (or of every rank, keyed by (name, rank))."""

    def __init__(self, expected: Mapping[object, tuple[int, ...]]) -> None:
        self.expected = dict(expected)
        self.writes: dict[object, list[Region]] = {}
        self.notes: list[str] = []

    def record(self, key: object, region: Region) -> None:
        self.writes.setdefault(key, []).append(region)

    def note(self, message: str) -> None:
        """A problem found while writing (e.g. a name the loader skipped), reported with the check."""
        self.notes.append(message)

    def problems(self) -> list[str]:
        """Every parameter not written exactly once, as human-readable lines."""
        out = list(self.notes)
        for key in self.writes:
            if key not in self.expected:
                out.append(f"{_name(key)}: written but the rollout model has no such parameter")
        for key, shape in self.expected.items():
            out.extend(_check_one(_name(key), shape, self.writes.get(key, [])))
        return out

    def check(self) -> None:
        """Raise `CoverageError` naming every parameter that was not written exactly once."""
        problems = self.problems()
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CoverageError(f"weight sync coverage failed ({len(problems)} problems):\n  {shown}{more}")


def _name(key: object) -> str:
    if isinstance(key, tuple):
        return f"{key[0]} (rollout rank {key[1]})"
    return str(key)


def _check_one(name: str, shape: tuple[int, ...], regions: list[Region]) -> list[str]:
    if not regions:
        return [f"{name}: never written"]
    if not shape:
        return [] if len(regions) == 1 else [f"{name}: written {len(regions)} times"]
    dims = {r.dim for r in regions if r.dim is not None}
    if len(dims) > 1:
        return [f"{name}: written along dims {sorted(dims)}; slabs of different dims overlap"]
    dim = dims.pop() if dims else 0
    spans = sorted((0, shape[dim]) if r.dim is None else (r.start, r.stop) for r in regions)
    out = []
    pos = 0
    for a, b in spans:
        if a < 0 or b > shape[dim] or a >= b:
            out.append(f"{name}: write [{a}, {b}) along dim {dim} is outside shape {tuple(shape)}")
        elif a < pos:
            out.append(f"{name}: elements [{a}, {min(b, pos)}) along dim {dim} written more than once")
        elif a > pos:
            out.append(f"{name}: elements [{pos}, {a}) along dim {dim} never written")
        pos = max(pos, b)
    if pos < shape[dim]:
        out.append(f"{name}: elements [{pos}, {shape[dim]}) along dim {dim} never written")
    return out


def check_plan(plan: SyncPlan, expected: Mapping[tuple[str, int], tuple[int, ...]] | None = None) -> None:
    """Check a plan alone: its pieces fill every rollout parameter exactly once, with matching sizes.

    `expected` defaults to the plan's own parameter list; pass the engine's real (name, rank) -> shape to
    also catch parameters the plan does not know.
    """
    ledger = CoverageLedger(expected if expected is not None else {k: p.shape for k, p in plan.params.items()})
    for key, p in plan.params.items():
        total = 0
        for pc in p.pieces:
            ledger.record(key, pc.dst)
            total += pc.numel
            if pc.dst.dim is not None:
                want = (pc.dst.stop - pc.dst.start) * math.prod(s for i, s in enumerate(p.shape) if i != pc.dst.dim)
                if want != pc.numel:
                    ledger.note(f"{_name(key)}: piece from {pc.megatron} carries {pc.numel} elements for a "
                                f"slice of {want}")
        if total != math.prod(p.shape):
            ledger.note(f"{_name(key)}: pieces carry {total} elements for {math.prod(p.shape)}")
    ledger.check()
