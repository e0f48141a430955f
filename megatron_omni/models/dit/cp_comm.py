"""Differentiable collectives for context-parallel attention, each with its exact adjoint in backward.

- `seq_to_heads` / `heads_to_seq`: the Ulysses all-to-all pair. One is the other's adjoint, so each
  backward is the other's forward.
- `gather_along_dim`: all-gather along one dimension; backward is the reduce-scatter (sum) of the
  gradient, because every rank's copy of the gathered tensor feeds its own share of the total loss.
- `RingExchange`: the point-to-point shift to the next rank of the ring used inside ring attention
  (which writes its own backward; see `cp_ring`).

Groups are `torch.distributed.ProcessGroup`s or None (meaning a group of one rank: every op is the
identity). Buffers are allocated on the input tensor's device, so nothing here names a device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in `group` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index inside `group` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    s, b, n, d = x.shape
    # Chunk j of the send buffer goes to rank j: our sequence shard restricted to head slice j.
    send = x.reshape(s, b, world, n // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] is rank i's sequence shard (our head slice); shards are in rank order along the sequence.
    return recv.reshape(world * s, b, n // world, d)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    s_full, b, n_local, d = x.shape
    s = s_full // world
    # Chunk j of the send buffer is sequence shard j (all of our heads) and goes back to rank j.
    send = x.reshape(world, s, b, n_local, d).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] holds head slice i of our own sequence shard.
    return recv.permute(1, 2, 0, 3, 4).reshape(s, b, world * n_local, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: D102
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # noqa: D102
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def seq_to_heads(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Ulysses all-to-all: `[s_local, b, n, d]` -> `[U * s_local, b, n / U, d]` (U = group size).

    Rank u ends up with head slice `[u * n / U, (u + 1) * n / U)` of the sequence shards of all ranks,
    concatenated in group-rank order. Requires `n % U == 0` and equal `s_local` on every rank.
    """
    if group_size(group) == 1:
        return x
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Inverse Ulysses all-to-all: `[U * s_local, b, n / U, d]` -> `[s_local, b, n, d]`."""
    if group_size(group) == 1:
        return x
    return _HeadsToSeq.apply(x, group)


def _all_gather_dim0(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:  # noqa: D102
        ctx.dim, ctx.group = dim, group
        return _all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        return _reduce_scatter_dim0(grad.movedim(ctx.dim, 0), ctx.group).movedim(0, ctx.dim), None, None


def gather_along_dim(x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
    """All-gather `x` along `dim` in group-rank order (equal sizes on every rank).

    Backward reduce-scatters (sums) the incoming gradient: the gathered tensor is replicated, and each
    rank's gradient is only its own part of the total, so rank i gets the sum over ranks of slice i.
    """
    if group_size(group) == 1:
        return x
    return _GatherAlongDim.apply(x, dim, group)


class RingExchange:
    """Shift a tensor one step along the ring: send ours to rank+1, receive rank-1's (asynchronously).

    `start(x)` posts the send and the receive and returns at once so that the caller can compute on
    the block it holds meanwhile; `wait()` returns the received tensor.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + 1) % world)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % world)
        self._reqs: list = []
        self._send: Tensor | None = None
        self._recv: Tensor | None = None

    def start(self, x: Tensor) -> None:
        """Post send of `x` (kept alive until `wait`) to the next rank and a receive from the previous."""
        if self._reqs:
            raise RuntimeError("RingExchange.start called twice without wait()")
        self._send = x.contiguous()
        self._recv = torch.empty_like(self._send)
        ops = [
            dist.P2POp(dist.isend, self._send, self.next_rank, group=self.group),
            dist.P2POp(dist.irecv, self._recv, self.prev_rank, group=self.group),
        ]
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> Tensor:
        """Block until the exchange finished; return the tensor received from the previous rank."""
        if not self._reqs or self._recv is None:
            raise RuntimeError("RingExchange.wait called without start()")
        for req in self._reqs:
            req.wait()
        received, self._recv, self._reqs, self._send = self._recv, None, [], None
        return received
