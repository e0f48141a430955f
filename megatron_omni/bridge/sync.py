"""Run a `SyncPlan`: move this trainer rank's Megatron shards into the rollout model, bucket by bucket.

`full` mode: per bucket, all-gather the shards over trainer tp (one flat buffer), rebuild full tensors,
convert to diffusers names, hand them through a transport to the engine's loader. `direct` mode (trainer
tp == rollout tp, rollout colocated with the trainer ranks): copy each piece of this rank's own shards
straight into the rollout parameter slice; only tensors the rollout replicates but Megatron shards are
all-gathered first (bucketed). After every sync the coverage ledger checks that every element of every
rollout parameter on this rank was written exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_omni.bridge.coverage import CoverageLedger
from megatron_omni.bridge.plan import Piece, Region, SourceTensor, SyncPlan, bucketize
from megatron_omni.bridge.targets import RolloutTarget
from megatron_omni.bridge.transport import InProcessTransport, Items, Transport

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass
class SyncStats:
    """What one sync did on this rank."""

    mode: str
    buckets: int
    bytes_loaded: int  # bytes written into this rank's rollout parameters
    bytes_gathered: int  # bytes received from other trainer tp ranks
    bytes_transported: int  # bytes of flat buffers moved by the transport
    peak_extra_bytes: int  # largest temporary memory held for one bucket
    seconds: float


def narrow(t: torch.Tensor, region: Region) -> torch.Tensor:
    """The view of `t` that `region` names."""
    return t if region.dim is None else t.narrow(region.dim, region.start, region.stop - region.start)


def qkv_part(shard: torch.Tensor, groups: int, heads_per_group: int, part: int) -> torch.Tensor:
    """Part `part` (0 q, 1 k, 2 v) of a per-group interleaved q|k|v shard [groups * (hpg + 2) * d, ...], as
    [groups, rows of the part in one group, ...] (q: hpg * d rows, k and v: d rows each)."""
    per = shard.unflatten(0, (groups, -1))
    d = per.shape[1] // (heads_per_group + 2)
    lo, hi = ((0, heads_per_group * d), (heads_per_group * d, (heads_per_group + 1) * d),
              ((heads_per_group + 1) * d, (heads_per_group + 2) * d))[part]
    return per[:, lo:hi]


def copy_piece(dst_param: torch.Tensor, piece: Piece, shard: torch.Tensor, groups: int,
               heads_per_group: int = 1) -> int:
    """Copy one planned piece from a Megatron shard (holding `groups` query groups of `heads_per_group` heads
    each when it is a fused qkv) into a rollout parameter; returns elements copied."""
    dst = narrow(dst_param, piece.dst)
    if piece.qkv is not None:
        g0, g1, part = piece.qkv
        # Write through a [groups, rows, ...] view of the destination: one strided copy, no temporary.
        dst.view(g1 - g0, -1, *dst.shape[1:]).copy_(qkv_part(shard, groups, heads_per_group, part)[g0:g1])
    else:
        dst.copy_(narrow(shard, piece.src))
    return piece.numel


def to_hf(src: SourceTensor, full: torch.Tensor, num_heads: int, num_groups: int | None = None,
          trainer_tp: int = 1, out: torch.Tensor | None = None) -> Items:
    """A Megatron tensor (its tp shards concatenated in rank order) -> its Hugging Face-named tensors: q, k, v
    split out of the per-group interleave, gate and up out of the per-rank `[gate_r; up_r]` blocks. The split
    tensors are copies: into `out` (a flat buffer of `full.numel()` elements, the parts one after another) when
    given, else into fresh tensors."""
    if src.kind == "fuse_qkv":
        groups = num_heads if num_groups is None else num_groups
        parts = [qkv_part(full, groups, num_heads // groups, i) for i in range(len(src.hf))]
    elif src.kind == "fuse_gate_up":
        blocks = full.unflatten(0, (trainer_tp if src.tp_dim is not None else 1, 2, -1))
        parts = [blocks[:, i] for i in range(len(src.hf))]
    else:
        return [(src.hf[0], full)]
    if out is None:
        return [(name, part.flatten(0, 1)) for name, part in zip(src.hf, parts)]
    items, off = [], 0
    for name, part in zip(src.hf, parts):
        dst = out[off:off + part.numel()].view(part.shape)
        dst.copy_(part)
        items.append((name, dst.flatten(0, 1)))
        off += part.numel()
    return items


class WeightSync:
    """Sync one trainer rank's Megatron shards into a rollout model, following a plan.

    `sources`: this rank's Megatron tensors by global Megatron name (local tp shards of its pipeline
    stage), or None on a rank without a trainer. `target`: the rollout model on this rank, or None.
    `tp_group`/`tp_rank`/`stage`: this trainer rank's tensor-parallel group, rank in it and pipeline stage.
    """

    def __init__(
        self,
        plan: SyncPlan,
        *,
        sources: Mapping[str, torch.Tensor] | None,
        target: RolloutTarget | None,
        tp_group: dist.ProcessGroup | None = None,
        tp_rank: int = 0,
        stage: int = 0,
        transport: Transport | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.plan = plan
        # kept as given: a mapping may compute its values when read (`lora_sync.MergedSources`)
        self.sources = sources
        self.target = target
        self.tp_group = tp_group
        self.tp_rank = tp_rank
        self.stage = stage
        self.transport = transport if transport is not None else InProcessTransport(target is not None)
        self.dtype = next(iter(self.sources.values())).dtype if self.sources else dtype
        self.bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=self.dtype).element_size())
        if self.sources is not None:
            self._check_sources()
        # Computed once: the schedule and the per-name rollout slices are the same every sync.
        self._buckets = plan.full_buckets(self.bucket_numel) if plan.mode == "full" else []
        # q/k/v (gate/up) split out of their interleave go into one buffer kept between buckets and syncs: a
        # fresh tensor per split costs first-touch page faults every sync (on CPU 3-4x the copy itself); a GPU's
        # caching allocator keeps the same memory anyway. Its size is the largest bucket's split tensors.
        self._split_numel = max((sum(s.full_numel for s in b if s.kind != "copy") for b in self._buckets), default=0)
        self._split: torch.Tensor | None = None
        self._expected: dict[str, tuple[int, ...]] = {}
        self._loads: dict[str, list[tuple[str, Region, int]]] = {}
        if target is not None:
            params = target.parameters()
            self._expected = {n: tuple(p.shape) for n, p in params.items()}
            for (name, rank), rp in plan.params.items():
                if rank != target.tp_rank:
                    continue
                for pc in rp.pieces:
                    n = narrow(params[name], pc.dst).numel() if name in params else 0
                    self._loads.setdefault(pc.hf, []).append((name, pc.dst, n))
        if target is not None and target.tp_size != plan.rollout_tp:
            raise ValueError(f"plan is for rollout tp={plan.rollout_tp}, target has tp={target.tp_size}")
        if plan.mode == "direct":
            if self.sources is None or target is None:
                raise ValueError("direct mode needs the trainer shards and the rollout model on the same rank")
            if plan.trainer_pp != 1:
                raise ValueError("direct mode needs trainer pp=1 (every rank must hold all blocks)")
            if target.tp_rank != tp_rank:
                raise ValueError(f"direct mode: trainer tp rank {tp_rank} must host rollout tp rank {tp_rank}, "
                                 f"got rollout rank {target.tp_rank}")
            self._remote = self._remote_pieces()

    def _check_sources(self) -> None:
        for s in self.plan.sources:
            if s.stage != self.stage:
                continue
            t = self.sources.get(s.megatron)
            if t is None:
                raise KeyError(f"trainer rank holds no tensor {s.megatron!r} that the plan reads")
            if tuple(t.shape) != s.local_shape:
                raise ValueError(f"{s.megatron}: local shard {tuple(t.shape)}, plan expects {s.local_shape}")

    def _remote_pieces(self) -> dict[str, list[tuple[str, Piece]]]:
        out: dict[str, list[tuple[str, Piece]]] = {}
        for name, p in self.plan.rank_params(self.target.tp_rank).items():
            for pc in p.pieces:
                if pc.tp_rank != self.tp_rank:
                    out.setdefault(pc.megatron, []).append((name, pc))
        return out

    # ------------------------------------------------------------------------------------------ gathers

    def _gather(self, bucket: list[SourceTensor]) -> tuple[dict[str, list[torch.Tensor]], int, int]:
        """Every tp rank's shard of each tensor of the bucket: (shards by name, bytes received, extra bytes)."""
        tp = self.plan.trainer_tp
        out = {s.megatron: [self.sources[s.megatron]] * tp for s in bucket if s.tp_dim is None}
        sharded = [s for s in bucket if s.tp_dim is not None]
        if not sharded:
            return out, 0, 0
        if tp == 1:
            out.update({s.megatron: [self.sources[s.megatron]] for s in sharded})
            return out, 0, 0
        flat = torch.cat([self.sources[s.megatron].reshape(-1) for s in sharded])
        gathered = torch.empty(tp * flat.numel(), dtype=flat.dtype, device=flat.device)
        chunks = list(gathered.chunk(tp))
        dist.all_gather(chunks, flat, group=self.tp_group)
        off = 0
        for s in sharded:
            n = s.local_numel
            out[s.megatron] = [c[off:off + n].view(s.local_shape) for c in chunks]
            off += n
        size = flat.element_size()
        return out, (tp - 1) * flat.numel() * size, (flat.numel() + gathered.numel()) * size

    # ------------------------------------------------------------------------------------------ modes

    @torch.no_grad()
    def sync(self) -> SyncStats:
        """Move the current trainer weights into the rollout model and check coverage; collective."""
        t0 = time.perf_counter()
        ledger = CoverageLedger(self._expected) if self.target is not None else None
        stats = self._full(ledger) if self.plan.mode == "full" else self._direct(ledger)
        if ledger is not None:
            ledger.check()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _full(self, ledger: CoverageLedger | None) -> SyncStats:
        stats = SyncStats("full", 0, 0, 0, 0, 0, 0.0)
        plan = self.plan
        for bucket in self._buckets:
            stats.buckets += 1
            items = None
            extra = 0
            if self.sources is not None and bucket[0].stage == self.stage:
                shards, received, extra = self._gather(bucket)
                stats.bytes_gathered += received
                items = []
                split_off = 0
                for s in bucket:
                    parts = shards[s.megatron]
                    full = parts[0] if len(parts) == 1 or s.tp_dim is None else torch.cat(parts, dim=s.tp_dim)
                    if full is not parts[0]:
                        extra += full.numel() * full.element_size()
                    out = None
                    if s.kind != "copy":  # q/k/v (gate/up) split out of their interleave are copies
                        out = self._split_buffer(full)[split_off:split_off + full.numel()]
                        split_off += full.numel()
                    items.extend(to_hf(s, full, plan.num_heads, plan.groups, plan.trainer_tp, out=out))
                extra += split_off * (self._split.element_size() if self._split is not None else 0)
            items, moved = self.transport.exchange(bucket, items)
            stats.bytes_transported += moved
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra + moved)
            if items is None or self.target is None:
                continue
            loaded = self.target.load_full(items)
            for name, t in items:
                # loaded by its name, or every rollout parameter it fills reported loaded (a renamed tensor)
                fills = self._loads.get(name, ())
                if name not in loaded and not (fills and all(pname in loaded for pname, _, _ in fills)):
                    ledger.note(f"{self.target.kind} loader skipped diffusers tensor {name!r}")
                    continue
                for pname, region, numel in self._loads.get(name, ()):
                    ledger.record(pname, region)
                    stats.bytes_loaded += numel * t.element_size()
        return stats

    def _split_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The kept split buffer, (re)made when the trainer tensors' dtype or device differs from it."""
        if self._split is None or self._split.dtype != like.dtype or self._split.device != like.device:
            self._split = torch.empty(self._split_numel, dtype=like.dtype, device=like.device)
        return self._split

    def _direct(self, ledger: CoverageLedger) -> SyncStats:
        stats = SyncStats("direct", 0, 0, 0, 0, 0, 0.0)
        params = self.target.parameters()
        groups = self.plan.groups // self.plan.trainer_tp
        per_group = self.plan.num_heads // self.plan.groups
        size = self.dtype.itemsize
        for name, p in self.plan.rank_params(self.target.tp_rank).items():
            dst = params.get(name)
            for pc in p.pieces:
                if pc.tp_rank != self.tp_rank:
                    continue
                ledger.record(name, pc.dst)
                if dst is not None:
                    stats.bytes_loaded += copy_piece(dst, pc, self.sources[pc.megatron], groups, per_group) * size
        # Tensors Megatron shards but the rollout replicates: gather them, bounded by the bucket size.
        remote = [s for s in self.plan.remote_sources() if s.stage == self.stage]
        for bucket in bucketize(remote, self.bucket_numel, lambda s: s.full_numel):
            stats.buckets += 1
            shards, received, extra = self._gather(bucket)
            stats.bytes_gathered += received
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
            for s in bucket:
                for name, pc in self._remote.get(s.megatron, []):
                    ledger.record(name, pc.dst)
                    if name in params:
                        stats.bytes_loaded += copy_piece(params[name], pc, shards[s.megatron][pc.tp_rank], groups,
                                                           per_group) * size
        return stats
