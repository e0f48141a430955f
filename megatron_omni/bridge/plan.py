"""The pure sync planner: Megatron shards -> rollout parameters, as an explicit list of copies.

From the model provider's data (Megatron <-> diffusers mappings and full Megatron shapes), the trainer's
tensor/pipeline sizes, and the rollout layout (see `model_providers/qwen_image/rollout_layouts.py`) and
tensor-parallel size, the planner lists for every rollout parameter on every rollout rank the `Piece`s
that fill it: which trainer shard (Megatron name, pipeline stage, tp rank), which slice of that shard
(a plain slice, or heads and q/k/v part of Megatron's per-head interleaved `linear_qkv`), and which slice
of the rollout parameter it lands in. Nothing here touches torch.distributed or allocates tensors: a
20B plan is built from shapes alone, and its coverage is checked with `coverage.check_plan`.

Mapping kinds: `copy` (one tensor, same layout); `fuse_qkv` (q, k, v -> Megatron's interleave per query
group `[q heads of the group | k | v]`: with as many groups as heads (the MMDiT) that is per head
`[q | k | v]`; with fewer it is GQA (the AR-DiT's Qwen2 decoder)); `fuse_gate_up` (SwiGLU's gate and up
projections -> `linear_fc1`, where each tp shard is `[gate_r; up_r]`, so the full tensor is not `[gate; up]`).

Modes: `full` gathers each Megatron tensor over trainer tp and hands full diffusers-named tensors to the
engine's loader (any rollout tp); `direct` (trainer tp == rollout tp) writes each piece straight into the
rollout parameter; pieces whose trainer tp rank equals the rollout rank are local copies, the rest
(tensors Megatron shards but the rollout replicates, e.g. adaLN for vLLM-Omni) are gathered first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MODES = ("full", "direct")


class PlanError(ValueError):
    """The requested sync cannot be planned; the message names the tensor or size at fault."""


@dataclass(frozen=True, slots=True)
class Region:
    """`[start, stop)` along `dim` of a tensor (all of every other dim); `dim=None` is the whole tensor."""

    dim: int | None
    start: int = 0
    stop: int = 0


WHOLE = Region(None)


@dataclass(frozen=True, slots=True)
class Piece:
    """One copy from a trainer shard into a rollout parameter.

    `qkv = (first_group, stop_group, part)` selects query groups (local to the shard) and the q/k/v part of a
    per-group interleaved shard viewed as [groups, heads_per_group + 2, head_dim, ...]; otherwise `src`
    slices the shard.
    `dst` is the slice of the rollout parameter (on rollout rank `dst_rank`) it fills.
    """

    megatron: str
    hf: str
    stage: int
    tp_rank: int
    dst_rank: int
    qkv: tuple[int, int, int] | None
    src: Region
    dst: Region
    numel: int


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """A Megatron tensor: its mapping data, owning stage, full and per-tp-rank shapes."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # "copy" | "fuse_qkv" | "fuse_gate_up"
    tp_dim: int | None
    stage: int
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    hf_shapes: tuple[tuple[int, ...], ...]

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass
class RolloutParam:
    """A rollout parameter on one rollout rank: its local shape and the pieces that fill it."""

    name: str
    rank: int
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class SyncPlan:
    """What goes where for one (trainer layout, rollout kind, rollout tp, mode)."""

    mode: str
    trainer_tp: int
    trainer_pp: int
    rollout_kind: str
    rollout_tp: int
    num_heads: int
    load_prefix: str
    sources: list[SourceTensor]
    params: dict[tuple[str, int], RolloutParam]
    num_groups: int = 0  # query groups of `fuse_qkv` tensors; 0 = num_heads (no GQA)

    @property
    def groups(self) -> int:
        """Query groups of the fused qkv tensors (= num_heads without GQA)."""
        return self.num_groups or self.num_heads

    def __post_init__(self) -> None:
        self._by_hf: dict[tuple[str, int], list[tuple[str, Region]]] = {}
        for (name, rank), p in self.params.items():
            for pc in p.pieces:
                self._by_hf.setdefault((pc.hf, rank), []).append((name, pc.dst))

    def rank_params(self, rank: int) -> dict[str, RolloutParam]:
        """The rollout parameters of rollout rank `rank`, by name."""
        return {name: p for (name, r), p in self.params.items() if r == rank}

    def regions_of(self, hf_name: str, rank: int) -> list[tuple[str, Region]]:
        """(rollout parameter, slice) pairs that loading the full diffusers tensor `hf_name` fills on `rank`."""
        return self._by_hf.get((hf_name, rank), [])

    def remote_sources(self) -> list[SourceTensor]:
        """Megatron tensors some rollout rank needs from another trainer tp rank (direct mode gathers them)."""
        names = {pc.megatron for (_, r), p in self.params.items() for pc in p.pieces if pc.tp_rank != r}
        return [s for s in self.sources if s.megatron in names]

    def numel_per_rollout_rank(self) -> list[int]:
        """Elements each rollout rank receives (its parameters' sizes)."""
        out = [0] * self.rollout_tp
        for (_, r), p in self.params.items():
            out[r] += math.prod(p.shape)
        return out

    def local_numel(self, rank: int) -> tuple[int, int]:
        """(elements copied locally, elements that need another tp rank's shard) for rollout rank `rank`."""
        local = remote = 0
        for p in self.rank_params(rank).values():
            for pc in p.pieces:
                if pc.tp_rank == rank:
                    local += pc.numel
                else:
                    remote += pc.numel
        return local, remote

    def full_buckets(self, bucket_numel: int) -> list[list[SourceTensor]]:
        """Megatron tensors grouped per stage into buckets of at most `bucket_numel` full elements.

        A tensor larger than the bucket gets a bucket of its own. Every rank computes the same list.
        """
        return bucketize(self.sources, bucket_numel, lambda s: s.full_numel)


def bucketize(sources: Sequence[SourceTensor], bucket_numel: int, size: Any) -> list[list[SourceTensor]]:
    """Consecutive runs of `sources` of one stage, each summing `size(s)` to at most `bucket_numel`."""
    if bucket_numel < 1:
        raise PlanError(f"bucket size must be positive, got {bucket_numel} elements")
    buckets: list[list[SourceTensor]] = []
    current: list[SourceTensor] = []
    used = 0
    for s in sorted(sources, key=lambda s: s.stage):
        n = size(s)
        if current and (used + n > bucket_numel or current[0].stage != s.stage):
            buckets.append(current)
            current, used = [], 0
        current.append(s)
        used += n
    if current:
        buckets.append(current)
    return buckets


def _stage(mapping: Any, num_layers: int, pp: int) -> int:
    if mapping.stage == "block":
        return mapping.layer // (num_layers // pp)
    if mapping.stage == "post":
        return pp - 1
    return 0  # "pre", and "all" (replicated on every stage: any stage is a valid source)


def _div(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise PlanError(f"{what}: {total} does not split evenly over {parts} ranks")
    return total // parts


def plan_sync(
    mappings: Iterable[Any],
    shapes: dict[str, tuple[int, ...]],
    *,
    num_heads: int,
    num_layers: int,
    layout: Any,
    trainer_tp: int,
    trainer_pp: int = 1,
    rollout_tp: int = 1,
    mode: str = "full",
    num_groups: int | None = None,
) -> SyncPlan:
    """Plan a sync (see the module docstring).

    `mappings`: the provider's `ParamMapping`s (megatron, hf, kind, tp_dim, layer, stage); `shapes`: full
    Megatron shape per name; `layout`: a `RolloutLayout` (kind, `rule(hf_name)`, load_prefix, max_tp);
    `num_groups`: query groups of the fused qkv tensors (None: one per head).
    """
    if mode not in MODES:
        raise PlanError(f"unknown sync mode {mode!r}; known: {list(MODES)}")
    if mode == "direct" and trainer_tp != rollout_tp:
        raise PlanError(f"direct mode needs trainer tp == rollout tp, got {trainer_tp} and {rollout_tp}")
    if layout.max_tp is not None and rollout_tp > layout.max_tp:
        raise PlanError(f"{layout.kind} rollout supports tp <= {layout.max_tp}, got {rollout_tp}")
    if num_layers % trainer_pp:
        raise PlanError(f"{num_layers} blocks are not divisible by trainer pp={trainer_pp}")
    T, R = trainer_tp, rollout_tp
    G = num_heads if num_groups is None else num_groups
    mappings = list(mappings)
    if any(m.kind == "fuse_qkv" for m in mappings):  # heads only constrain a part with attention
        _div(num_heads, G, "attention heads over query groups")
        what = "attention heads" if G == num_heads else "query groups"
        _div(G, T, f"{what} over trainer tp")
        _div(G, R, f"{what} over rollout tp")

    sources: list[SourceTensor] = []
    params: dict[tuple[str, int], RolloutParam] = {}
    for m in mappings:
        if m.megatron not in shapes:
            raise PlanError(f"no shape for Megatron tensor {m.megatron!r}")
        full = tuple(shapes[m.megatron])
        local = list(full)
        if m.tp_dim is not None:
            local[m.tp_dim] = _div(full[m.tp_dim], T, f"{m.megatron} dim {m.tp_dim} over trainer tp")
        if m.kind == "fuse_qkv":
            if len(m.hf) != 3:
                raise PlanError(f"{m.megatron}: fuse_qkv needs 3 diffusers tensors, got {m.hf}")
            d = _div(full[0], num_heads + 2 * G, f"{m.megatron} rows over q, k and v heads")
            hf_shapes = ((num_heads * d, *full[1:]), (G * d, *full[1:]), (G * d, *full[1:]))
        elif m.kind == "fuse_gate_up":
            if len(m.hf) != 2:
                raise PlanError(f"{m.megatron}: fuse_gate_up needs 2 tensors (gate, up), got {m.hf}")
            hf_shapes = tuple((_div(full[0], 2, f"{m.megatron} rows into gate and up"), *full[1:]) for _ in range(2))
        elif m.kind == "copy":
            if len(m.hf) != 1:
                raise PlanError(f"{m.megatron}: copy needs 1 diffusers tensor, got {m.hf}")
            hf_shapes = (full,)
        else:
            raise PlanError(f"{m.megatron}: unknown mapping kind {m.kind!r}")
        src = SourceTensor(m.megatron, tuple(m.hf), m.kind, m.tp_dim, _stage(m, num_layers, trainer_pp), full,
                           tuple(local), hf_shapes)
        sources.append(src)
        for part, (hf_name, hf_shape) in enumerate(zip(m.hf, hf_shapes)):
            try:
                pname, rule = layout.rule(hf_name)
            except KeyError as e:
                raise PlanError(str(e.args[0])) from None
            for r in range(R):
                shape, need, base = _rollout_slot(rule, hf_shape, r, R, pname)
                key = (pname, r)
                if key not in params:
                    params[key] = RolloutParam(pname, r, shape)
                elif params[key].shape != shape:
                    raise PlanError(f"{pname}: shapes {params[key].shape} and {shape} disagree (from {hf_name})")
                params[key].pieces.extend(_pieces(src, hf_name, hf_shape, part, need, base, r, T, G // T))
    return SyncPlan(mode, T, trainer_pp, layout.kind, R, num_heads, layout.load_prefix, sources, params,
                    num_groups=0 if G == num_heads else G)


def _rollout_slot(rule: Any, hf_shape: tuple[int, ...], r: int, R: int, pname: str
                  ) -> tuple[tuple[int, ...], Region, int]:
    """(local rollout parameter shape, region of the diffusers tensor rank r needs, offset in the param)."""
    if rule.split == "replicated":
        return hf_shape, WHOLE, 0
    if rule.split == "column":
        n = _div(hf_shape[0], R, f"{pname} rows over rollout tp")
        return (n, *hf_shape[1:]), Region(0, r * n, (r + 1) * n), 0
    if rule.split == "row":
        if len(hf_shape) != 2:
            raise PlanError(f"{pname}: row-parallel split needs a 2-d weight, got {hf_shape}")
        n = _div(hf_shape[1], R, f"{pname} columns over rollout tp")
        return (hf_shape[0], n), Region(1, r * n, (r + 1) * n), 0
    if rule.split == "qkv":
        n = _div(hf_shape[0], R, f"{pname} rows over rollout tp")
        return (3 * n, *hf_shape[1:]), Region(0, r * n, (r + 1) * n), rule.part * n
    raise PlanError(f"{pname}: unknown rollout split {rule.split!r}")


def _pieces(src: SourceTensor, hf_name: str, hf_shape: tuple[int, ...], part: int, need: Region, base: int,
            r: int, T: int, groups_per_rank: int) -> list[Piece]:
    """Split the needed region of one diffusers tensor over the trainer tp ranks that hold it."""
    if src.tp_dim is None:
        # Replicated in Megatron: take it from the trainer rank colocated with rollout rank r when there is one.
        n = math.prod(hf_shape) if need.dim is None else (need.stop - need.start) * math.prod(
            s for i, s in enumerate(hf_shape) if i != need.dim)
        dst = WHOLE if need.dim is None else Region(need.dim, base, base + need.stop - need.start)
        return [Piece(src.megatron, hf_name, src.stage, r % T, r, None, need, dst, n)]
    dim = src.tp_dim
    if need.dim is not None and need.dim != dim:
        raise PlanError(f"{hf_name}: Megatron splits dim {dim} but the rollout needs a slice of dim {need.dim}")
    lo, hi = (0, hf_shape[dim]) if need.dim is None else (need.start, need.stop)
    inner = math.prod(s for i, s in enumerate(hf_shape) if i != dim)
    out = []
    if src.kind == "fuse_qkv":
        # A q part spans heads_per_group heads per query group, a k or v part one head per group: in units of
        # its per-group rows the trainer shard t holds groups [t * g, (t + 1) * g).
        unit = hf_shape[0] // (groups_per_rank * T)
        if lo % unit or hi % unit:
            raise PlanError(f"{hf_name}: rows [{lo}, {hi}) do not fall on query-group boundaries of {unit}")
        g_lo, g_hi = lo // unit, hi // unit
        for t in range(T):
            a, b = max(g_lo, t * groups_per_rank), min(g_hi, (t + 1) * groups_per_rank)
            if a >= b:
                continue
            dst = Region(0, base + (a - g_lo) * unit, base + (b - g_lo) * unit)
            qkv = (a - t * groups_per_rank, b - t * groups_per_rank, part)
            out.append(Piece(src.megatron, hf_name, src.stage, t, r, qkv, WHOLE, dst, (b - a) * unit * inner))
        return out
    if src.kind == "fuse_gate_up":
        # Shard t is [gate rows t; up rows t]: part p's rows [t * per, (t + 1) * per) sit at p * per in it.
        per = _div(hf_shape[0], T, f"{hf_name} rows over trainer tp")
        for t in range(T):
            a, b = max(lo, t * per), min(hi, (t + 1) * per)
            if a >= b:
                continue
            s = Region(0, part * per + a - t * per, part * per + b - t * per)
            out.append(Piece(src.megatron, hf_name, src.stage, t, r, None, s,
                             Region(0, base + a - lo, base + b - lo), (b - a) * inner))
        return out
    per = src.local_shape[dim]
    for t in range(T):
        a, b = max(lo, t * per), min(hi, (t + 1) * per)
        if a >= b:
            continue
        s = WHOLE if (a, b) == (t * per, (t + 1) * per) else Region(dim, a - t * per, b - t * per)
        out.append(Piece(src.megatron, hf_name, src.stage, t, r, None, s,
                         Region(dim, base + a - lo, base + b - lo), (b - a) * inner))
    return out
