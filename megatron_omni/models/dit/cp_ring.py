"""Ring attention over image key/value blocks, with replicated text keys, merged by log-sum-exp in fp32.

Queries (a text chunk and this ring rank's image block) attend over `[text keys ; image block 0 ; ... ;
image block R-1]`. The text block is local (text K/V are replicated on every ring rank, so each rank
uses its own copy exactly once); the image K/V blocks travel around the ring, one step per block, while
the current block is being computed. Partial results are merged with the online-softmax rule in fp32.

Backward is written out (flash-attention style), not left to autograd: forward keeps only the inputs,
the merged output and the merged log-sum-exp, and backward recomputes each block's probabilities from
the global log-sum-exp. The image K/V blocks go around the ring a second time, each carrying its fp32
dK/dV accumulator; after R steps every accumulator is back on the rank that owns the block. Each forward
send of a block (r -> r+1) thus has its adjoint: that block's gradient is returned along the ring to r.

Layout inside this module is `[b, n, s, d]` (batch, heads, sequence, head dim).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_omni.models.dit.cp_comm import RingExchange, group_size


def _acc(x: Tensor) -> Tensor:
    """`x` in the accumulation dtype: fp32 for half types, unchanged for fp32/fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(q: Tensor, k: Tensor, key_mask: Tensor | None, scale: float) -> Tensor:
    """Scaled scores `[b, n, s_q, s_k]` (at least fp32), -inf where `key_mask` ([b, s_k]) is False."""
    s = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return s


def _finite_or_zero(lse: Tensor) -> Tensor:
    # A row whose keys are all masked has lse = -inf; subtracting 0 instead keeps its weights at exactly 0.
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def attention_block_forward(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention of one key block, returning what a later merge needs.

    q `[b, n, s_q, d]`, k/v `[b, n, s_k, d]`, key_mask `[b, s_k]` bool or None.
    Returns `out` `[b, n, s_q, d]` (fp32 or wider, normalised within the block) and `lse` `[b, n, s_q]`
    (same dtype, the log-sum-exp of the block's scores; -inf with `out` = 0 for rows whose keys are all
    masked).
    """
    s = _scores(q, k, key_mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite_or_zero(lse)[..., None])
    return torch.matmul(p, _acc(v)), lse


def merge_attention_blocks(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Combine two blocks' attention results over disjoint key sets into the result over their union.

    out_* `[..., s_q, d]`, lse_* `[..., s_q]`, all fp32. Returns `(out, lse)` with
    `lse = log(exp(lse_a) + exp(lse_b))` and `out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)`.
    A block with lse = -inf (no valid key) contributes nothing.
    """
    # Weights relative to the larger lse (one of them is exactly 1): no precision lost to a large lse.
    top = torch.maximum(lse_a, lse_b)
    base = _finite_or_zero(top)
    w_a = torch.exp(lse_a - base)
    w_b = torch.exp(lse_b - base)
    total = w_a + w_b
    # total is 0 only where both blocks are empty; dividing by 1 there keeps out = 0 and lse = -inf.
    norm = torch.where(total == 0, torch.ones_like(total), total)
    out = (out_a * w_a[..., None] + out_b * w_b[..., None]) / norm[..., None]
    return out, top + torch.log(total)


def attention_block_backward(
    dout: Tensor,
    delta: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one key block's share of a merged attention, given the global statistics.

    dout `[b, n, s_q, d]` (fp32) is the gradient of the merged output, `lse` `[b, n, s_q]` the merged
    log-sum-exp and `delta` `[b, n, s_q]` = rowsum(dout * out) over the merged output. With
    P = exp(scores - lse) this block's slice of the global softmax: dV = P^T dout,
    dS = P (dout V^T - delta), dQ = scale dS K, dK = scale dS^T Q. Returns fp32 (dq, dk, dv).
    """
    qf, kf, vf = _acc(q), _acc(k), _acc(v)
    p = torch.exp(_scores(qf, kf, key_mask, scale) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, vf.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, dk, dv


class _RingJointAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: D102
        ctx,
        q: Tensor,
        k_txt: Tensor,
        v_txt: Tensor,
        k_img: Tensor,
        v_img: Tensor,
        txt_mask: Tensor | None,
        scale: float,
        ring_group: dist.ProcessGroup | None,
    ) -> Tensor:
        world = group_size(ring_group)
        out, lse = attention_block_forward(q, k_txt, v_txt, txt_mask, scale)
        kv = torch.stack([k_img, v_img])
        exchange = RingExchange(ring_group) if world > 1 else None
        for step in range(world):
            if exchange is not None and step < world - 1:
                exchange.start(kv)
            out_b, lse_b = attention_block_forward(q, kv[0], kv[1], None, scale)
            out, lse = merge_attention_blocks(out, lse, out_b, lse_b)
            if exchange is not None and step < world - 1:
                kv = exchange.wait()
        ctx.scale, ctx.ring_group = scale, ring_group
        ctx.save_for_backward(q, k_txt, v_txt, k_img, v_img, txt_mask, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple:  # noqa: D102
        q, k_txt, v_txt, k_img, v_img, txt_mask, out, lse = ctx.saved_tensors
        scale, ring_group = ctx.scale, ctx.ring_group
        world = group_size(ring_group)
        dout = _acc(dout)
        delta = (dout * out).sum(dim=-1)
        dq, dk_txt, dv_txt = attention_block_backward(dout, delta, q, k_txt, v_txt, txt_mask, lse, scale)
        kv = torch.stack([k_img, v_img])
        kv_exchange = RingExchange(ring_group) if world > 1 else None
        dkv_exchange = RingExchange(ring_group) if world > 1 else None
        dkv = None
        for step in range(world):
            # At step i this rank holds image block (r - i) mod R; its dK/dV accumulator follows it.
            if kv_exchange is not None and step < world - 1:
                kv_exchange.start(kv)
            dq_b, dk_b, dv_b = attention_block_backward(dout, delta, q, kv[0], kv[1], None, lse, scale)
            dq += dq_b
            if step == 0:
                dkv = torch.stack([dk_b, dv_b])
            else:
                # The accumulator was sent by the previous rank while this block's gradients were computed.
                dkv = dkv_exchange.wait()
                dkv[0] += dk_b
                dkv[1] += dv_b
            if dkv_exchange is not None:
                dkv_exchange.start(dkv)
            if kv_exchange is not None and step < world - 1:
                kv = kv_exchange.wait()
        if dkv_exchange is not None:
            # The R-th shift brings every accumulator home to the rank that owns the block.
            dkv = dkv_exchange.wait()
        return (
            dq.to(q.dtype),
            dk_txt.to(k_txt.dtype),
            dv_txt.to(v_txt.dtype),
            dkv[0].to(k_img.dtype),
            dkv[1].to(v_img.dtype),
            None,
            None,
            None,
        )


def ring_joint_attention(
    q: Tensor,
    k_txt: Tensor,
    v_txt: Tensor,
    k_img: Tensor,
    v_img: Tensor,
    txt_mask: Tensor | None,
    scale: float,
    ring_group: dist.ProcessGroup | None,
) -> Tensor:
    """Attention of `q` over `[text keys (masked) ; image K/V blocks of every ring rank]`.

    q `[b, n, s_q, d]`; k_txt/v_txt `[b, n, s_txt, d]` (the same on every ring rank);
    k_img/v_img `[b, n, s_blk, d]` this ring rank's image block (blocks in ring-rank order, equal sizes);
    txt_mask `[b, s_txt]` bool (True = valid) or None. Returns `[b, n, s_q, d]` in q's dtype.
    With `ring_group` None or of size 1 this is plain (blockwise, LSE-merged) attention.
    """
    return _RingJointAttention.apply(q, k_txt, v_txt, k_img, v_img, txt_mask, scale, ring_group)
