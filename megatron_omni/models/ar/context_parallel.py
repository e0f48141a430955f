"""Context parallelism for the AR decoder without TransformerEngine: Ulysses all-to-all around causal SDPA.

Megatron-Core's own context parallelism for GPT runs inside TransformerEngine's attention (and its RoPE
slicing moves an index to CUDA), so the local spec has none. This is the same layout, USP-style:

- Tokens are split the way Megatron-Core splits them (`get_batch_on_this_cp_rank`): the sequence in 2 * CP
  chunks, rank r holding chunks r and 2 * CP - 1 - r (causal work balanced across ranks). `split_sequence`
  does it for any tensor; labels are split like the tokens (pre-shifted), so each rank's loss covers its
  own positions and the gradients are summed over the cp group like any data-parallel replica's.
- Each layer's core attention (`UlyssesCausalAttention`) all-to-alls q, k, v from sequence shards to head
  shards (the MMDiT's `cp_comm.seq_to_heads`), puts the gathered chunks back in sequence order, runs causal
  SDPA over the whole sequence, and returns its output to the sequence shards.
- RoPE: `zigzag_rotary` takes the full-length table's rows of this rank's chunks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_omni.models.dit.cp_comm import gather_along_dim, group_rank, group_size, heads_to_seq, seq_to_heads


def zigzag_positions(seq_len: int, cp: int, rank: int) -> Tensor:
    """Global positions [seq_len / cp] of cp rank `rank`'s tokens: chunks `rank` and `2 * cp - 1 - rank`."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


@functools.lru_cache(maxsize=64)
def _gathered_order(seq_len: int, cp: int) -> tuple[Tensor, Tensor]:
    """(positions, order) [seq_len] each, on the CPU: the global position of each row of a cp-rank-ordered gather
    of all ranks' shards, and the permutation that puts those rows in sequence order. Cached: every layer of
    every forward asks for the same few lengths."""
    positions = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)])
    return positions, torch.argsort(positions)


def split_sequence(x: Tensor, dim: int, cp_group) -> Tensor:
    """This cp rank's shard of `x` along `dim` (length L -> L / cp, chunks r and 2cp-1-r); identity at cp=1."""
    cp = group_size(cp_group)
    if cp == 1:
        return x
    idx = zigzag_positions(x.shape[dim], cp, group_rank(cp_group)).to(x.device)
    return x.index_select(dim, idx)


def gather_sequence(x: Tensor, dim: int, cp_group, grad: str = "slice") -> Tensor:
    """Inverse of `split_sequence`: all ranks' shards along `dim` in sequence order, differentiable.

    Every cp rank holds a copy of the result; its backward depends on what each rank's gradient of that copy is
    (Megatron's convention: the loss, the same on every cp rank, is scaled by cp and DDP averages over dp x cp):
    - `grad="slice"`: the whole gradient, the same on every rank (the loss is computed from the copy on every
      rank, e.g. token log-probs): keep this rank's slice.
    - `grad="sum"`: a per-rank share of it (the copy feeds context-parallel work whose backward splits the
      gradient across ranks, e.g. the DiT's text stream): reduce-scatter (sum) the shares.
    """
    if grad not in ("slice", "sum"):
        raise ValueError(f"grad must be 'slice' or 'sum', got {grad!r}")
    cp = group_size(cp_group)
    if cp == 1:
        return x
    if grad == "sum":
        gathered = gather_along_dim(x, dim, cp_group)
    else:
        gathered = gather_from_sequence_parallel_region(x.movedim(dim, 0).contiguous(),
                                                        tensor_parallel_output_grad=False,
                                                        group=cp_group).movedim(0, dim)
    order = _gathered_order(gathered.shape[dim], cp)[1].to(x.device)
    return gathered.index_select(dim, order)


def zigzag_rotary(rotary_pos_emb: Tensor, cp_group) -> Tensor:
    """Megatron's RoPE table [S, 1, 1, d] for the full sequence -> this rank's rows [S / cp, 1, 1, d]."""
    return split_sequence(rotary_pos_emb, 0, cp_group)


class UlyssesCausalAttention(MegatronModule):
    """Core attention (the `core_attention` of Megatron-Core's local GPT layer spec) under context parallelism:
    q/k/v `[s / cp, b, heads, d]` -> all-to-all -> causal SDPA over the whole sequence -> `[s / cp, b, heads * d]`.

    Grouped-query k/v are expanded to the query heads before the all-to-all (so `heads / tp` must be divisible
    by cp, not the query groups). Right padding needs no mask: a padded position never precedes a real one.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection=None,
                 **unused) -> None:
        super().__init__(config=config)
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        self.softmax_scale = softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *unused,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        """query [s_local, b, n, d], key/value [s_local, b, g, d] -> context [s_local, b, n * d]."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("Ulysses decoder attention supports neither attention_bias nor packed sequences")
        s_local, b, n, d = query.shape
        cp = group_size(self.cp_group)
        if n % cp:
            raise ValueError(f"{n} attention heads per tp rank are not divisible by cp={cp}")
        if key.shape[2] != n:
            key = key.repeat_interleave(n // key.shape[2], dim=2)
            value = value.repeat_interleave(n // value.shape[2], dim=2)
        q, k, v = (seq_to_heads(x, self.cp_group) for x in (query, key, value))  # [S, b, n / cp, d]
        positions = None
        if cp > 1:  # rows in cp-rank order -> sequence order
            positions, order = (t.to(q.device) for t in _gathered_order(q.shape[0], cp))
            q, k, v = (x.index_select(0, order) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                             is_causal=True, scale=self.softmax_scale)
        out = out.permute(2, 0, 1, 3)  # [S, b, n / cp, d], sequence order
        if positions is not None:
            out = out.index_select(0, positions)
        return heads_to_seq(out.contiguous(), self.cp_group).reshape(s_local, b, n * d)
