"""How full-mode buckets reach the rollout model: in the same process, or over torch.distributed.

Each bucket is a list of diffusers-named full tensors whose names and shapes every rank derives from the
same plan, so only the bytes travel (one flat buffer per bucket, never more than one bucket at a time).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_omni.bridge.plan import SourceTensor

Items = list[tuple[str, torch.Tensor]]


def bucket_entries(bucket: Sequence[SourceTensor]) -> list[tuple[str, tuple[int, ...]]]:
    """(diffusers name, full shape) of every tensor of a bucket, in the order they are packed."""
    return [(hf, shape) for s in bucket for hf, shape in zip(s.hf, s.hf_shapes)]


class Transport(Protocol):
    """Moves one bucket from the trainer rank that gathered it to the ranks that host a rollout model."""

    def exchange(self, bucket: Sequence[SourceTensor], items: Items | None) -> tuple[Items | None, int]:
        """Return (the bucket's tensors if this rank hosts a rollout model else None, extra bytes used)."""
        ...


class InProcessTransport:
    """The rollout model lives in the trainer's process: the gathered tensors are handed over as they are."""

    def __init__(self, has_target: bool = True) -> None:
        self.has_target = has_target

    def exchange(self, bucket: Sequence[SourceTensor], items: Items | None) -> tuple[Items | None, int]:
        if self.has_target and items is None:
            raise RuntimeError("in-process transport: this rank hosts a rollout model but gathered no tensors "
                               "for the bucket (trainer pp > 1 needs the distributed transport)")
        return (items if self.has_target else None), 0


class DistributedTransport:
    """Rollout models on other ranks: the gathering rank of each stage broadcasts flat buckets to them.

    Construct on every rank of the job (it creates process groups); `sources[stage]` is the global rank
    that gathers stage `stage` (e.g. tp rank 0 of the first data-parallel replica), `rollout_ranks` the
    ranks holding a rollout model. `dtype` is the dtype of the trainer's parameters. `groups`: the broadcast
    group of each source ({source} + rollout ranks, None on a rank outside it) built by the caller
    (`parallel.placement.build_placement_groups`); without it they are created here.
    """

    def __init__(self, sources: Sequence[int], rollout_ranks: Sequence[int], dtype: torch.dtype,
                 groups: Mapping[int, dist.ProcessGroup | None] | None = None) -> None:
        self.rank = dist.get_rank()
        self.sources = list(sources)
        self.rollout_ranks = sorted(set(rollout_ranks))
        self.dtype = dtype
        self.groups: dict[int, dist.ProcessGroup | None] = {}
        if groups is not None:
            missing = sorted(set(self.sources) - set(groups))
            if missing:
                raise ValueError(f"no broadcast group given for source ranks {missing}")
            self.groups = dict(groups)
            return
        for src in sorted(set(self.sources)):
            members = sorted({src, *self.rollout_ranks})
            group = dist.new_group(members)  # collective over the whole job, in the same order everywhere
            self.groups[src] = group if self.rank in members else None

    def exchange(self, bucket: Sequence[SourceTensor], items: Items | None) -> tuple[Items | None, int]:
        src = self.sources[bucket[0].stage]
        group = self.groups[src]
        receiver = self.rank in self.rollout_ranks
        if group is None:
            return None, 0
        entries = bucket_entries(bucket)
        total = sum(math.prod(s) for _, s in entries)
        if self.rank == src:
            if items is None:
                raise RuntimeError(f"rank {src} sends stage {bucket[0].stage} but gathered nothing")
            flat = torch.cat([t.reshape(-1) for _, t in items]).to(self.dtype)
        else:
            flat = torch.empty(total, dtype=self.dtype)
        dist.broadcast(flat, src=src, group=group)
        extra = flat.numel() * flat.element_size()
        if not receiver:
            return None, extra
        if self.rank == src:
            return items, extra
        out, off = [], 0
        for name, shape in entries:
            n = math.prod(shape)
            out.append((name, flat[off:off + n].view(shape)))
            off += n
        return out, extra
