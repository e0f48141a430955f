"""BAGEL's Mixture-of-Transformers (MoT) decoder layer as Megatron-Core modules.

Every layer of BAGEL's Qwen2.5 decoder holds two experts: the understanding expert (text, ViT tokens and the
image start/end markers) and the generation expert (the VAE latent tokens). Each expert has its own q/k/v/o
projections, QK-norms, pre-attention and pre-MLP RMSNorms and SwiGLU MLP; attention itself is shared: every
token attends over the same keys (the cached prompt's and the current tokens' of both experts).

Here each expert's q/k/v and MLP fc1 are Megatron-Core `ColumnParallelLinear`s, o and fc2 `RowParallelLinear`s
(the MLPs are Megatron's `MLP`), so tensor parallelism splits both experts by query group / FFN column exactly
like a Megatron GPT layer. Tokens are routed by a boolean `gen_mask` over the packed sequence: `None` (the
understanding pass that builds the prompt's KV cache) sends every token through the understanding expert.

Shapes: packed tokens `[n, 1, h]` (Megatron's `[s, b, h]` with b = 1: BAGEL packs a request's tokens into one
sequence); RoPE frequencies `[n, 1, 1, d]` per token (BAGEL's position ids: all tokens of one generated image
share one position); KV `[m, g / tp, d]`.

Context parallelism (a generation step only): the image query's tokens are split into contiguous shards over the
cp group (`TokenShard`); each rank runs both experts on its own shard and all-gathers the shard's k/v (after
QK-norm and RoPE) before attending, because the generation attention is non-causal (every query reads every
image key). See docs/families-bagel.md for why this form and not Ulysses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omni.models.dit.cp_comm import gather_along_dim

KV = tuple[torch.Tensor, torch.Tensor]


def shard_bounds(total: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s contiguous shard when `total` tokens split over `size` ranks (sizes differ by at
    most one, none empty)."""
    if total < size:
        raise ValueError(f"{total} tokens cannot be split over {size} context-parallel ranks")
    return rank * total // size, (rank + 1) * total // size


def gather_uneven(x: torch.Tensor, group, lengths: list[int]) -> torch.Tensor:
    """All-gather contiguous shards of different lengths along dim 0 in group-rank order: x [lengths[rank], ...]
    -> [sum(lengths), ...]. Padded to the longest shard for the collective; backward is the reduce-scatter of
    `gather_along_dim` (each rank's gradient of the gathered copy is summed back into the shard's owner)."""
    c = max(lengths)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, c - x.shape[0]))
    full = gather_along_dim(padded, 0, group)
    keep = torch.cat([torch.arange(r * c, r * c + n, device=x.device) for r, n in enumerate(lengths)])
    return full.index_select(0, keep)


class TokenShard:
    """A sequence of `total` tokens split contiguously over the ranks of `group` (this rank holds `bounds`)."""

    def __init__(self, group, total: int) -> None:
        self.group, self.total = group, total
        size = group.size()
        self.lengths = [b - a for a, b in (shard_bounds(total, size, r) for r in range(size))]
        self.bounds = shard_bounds(total, size, group.rank())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard x [stop - start, ...] -> the whole sequence [total, ...] (differentiable)."""
        return gather_uneven(x, self.group, self.lengths)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 and cast back (BAGEL's `MoTRMSNorm` native path does the same), so a bf16 model
    normalises like the reference. Marked `sequence_parallel` like Megatron's norms (a no-op without SP)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.weight.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size] -> [..., size] in x's dtype."""
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def route(x: torch.Tensor, gen_mask: torch.Tensor | None, und: Callable, gen: Callable) -> torch.Tensor:
    """Apply `und` to the tokens where `gen_mask` is False and `gen` where it is True (dim 0), keeping order.

    Both callables map [k, ...] -> [k, ...out]; with `gen_mask` None every token goes through `und`."""
    if gen_mask is None:
        return und(x)
    a, b = und(x[~gen_mask]), gen(x[gen_mask])
    out = a.new_empty((x.shape[0], *a.shape[1:]))
    out[~gen_mask] = a
    out[gen_mask] = b
    return out


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class MoTAttention(MegatronModule):
    """Packed self-attention of both experts (q/k/v/o per expert, QK-norm per expert, shared softmax)."""

    def __init__(self, config: TransformerConfig, tp_group, cp_group, qk_norm: bool = True) -> None:
        super().__init__(config)
        self.cp_group = cp_group  # RoPE's helper reads Megatron's global cp group unless given one
        tp = tp_group.size()
        self.head_dim = config.kv_channels
        self.num_groups = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        qkv_out = config.num_query_groups * (self.heads_per_group + 2) * self.head_dim
        init = config.init_method
        for suffix in ("", "_gen"):
            setattr(self, f"linear_qkv{suffix}", tensor_parallel.ColumnParallelLinear(
                config.hidden_size, qkv_out, config=config, init_method=init, bias=True, gather_output=False,
                tp_group=tp_group))
            setattr(self, f"linear_proj{suffix}", tensor_parallel.RowParallelLinear(
                config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
                init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=False,
                tp_group=tp_group))
            if qk_norm:
                for which in ("q", "k"):
                    setattr(self, f"{which}_layernorm{suffix}",
                            RMSNorm(self.head_dim, config.layernorm_epsilon, config.params_dtype))
        self.qk_norm = qk_norm

    def _norm(self, x: torch.Tensor, which: str, gen_mask: torch.Tensor | None) -> torch.Tensor:
        if not self.qk_norm:
            return x
        return route(x, gen_mask, getattr(self, f"{which}_layernorm"), getattr(self, f"{which}_layernorm_gen"))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, gen_mask: torch.Tensor | None, prefix: KV | None,
                causal: bool, shard: TokenShard | None = None) -> tuple[torch.Tensor, KV]:
        """x [n, 1, h], rope [n, 1, 1, d] -> (out [n, 1, h], this call's (k, v) [n, g/tp, d] after norm + RoPE).

        `prefix`: cached (k, v) [m, g/tp, d] every query also attends to (the prompt's, for a generation step).
        `causal`: causal attention over the n tokens (only without a prefix: the understanding pass).
        `shard`: the n tokens are this rank's shard of a context-parallel sequence; every query attends over the
        whole sequence's k/v, gathered over the shard's group (non-causal only)."""
        n = x.shape[0]
        qkv = route(x, gen_mask, lambda t: _first(self.linear_qkv(t)), lambda t: _first(self.linear_qkv_gen(t)))
        qkv = qkv.view(n, 1, self.num_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(n, 1, -1, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        q = apply_rotary_pos_emb(self._norm(q, "q", gen_mask), rope, self.config, cp_group=self.cp_group)
        k = apply_rotary_pos_emb(self._norm(k, "k", gen_mask), rope, self.config, cp_group=self.cp_group)
        k, v = k[:, 0], v[:, 0]  # [n, g/tp, d]
        kv = (k, v)
        if shard is not None:
            if causal:
                raise ValueError("context parallelism gathers k/v for non-causal attention only")
            k, v = shard.gather(torch.stack((k, v), dim=-1)).unbind(-1)  # one collective for both
        if prefix is not None:
            if causal:
                raise ValueError("causal attention over a cached prefix is not used by BAGEL's generation step")
            k, v = torch.cat([prefix[0], k]), torch.cat([prefix[1], v])
        out = F.scaled_dot_product_attention(q[:, 0].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=causal, enable_gqa=True)
        out = out[0].transpose(0, 1).reshape(n, 1, -1)
        out = route(out, gen_mask, lambda t: _first(self.linear_proj(t)), lambda t: _first(self.linear_proj_gen(t)))
        return out, kv


class MoTLayer(MegatronModule):
    """One BAGEL decoder layer: pre-norm MoT attention and pre-norm MoT SwiGLU MLP, both with residuals."""

    def __init__(self, config: TransformerConfig, tp_group, cp_group, qk_norm: bool = True) -> None:
        super().__init__(config)
        eps, dtype = config.layernorm_epsilon, config.params_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.input_layernorm_gen = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attention = MoTAttention(config, tp_group, cp_group, qk_norm)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.pre_mlp_layernorm_gen = RMSNorm(config.hidden_size, eps, dtype)
        spec = MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear,
                             linear_fc2=tensor_parallel.RowParallelLinear)
        self.mlp = MLP(config, spec, tp_group=tp_group)
        self.mlp_gen = MLP(config, spec, tp_group=tp_group)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, gen_mask: torch.Tensor | None = None,
                prefix: KV | None = None, causal: bool = False,
                shard: TokenShard | None = None) -> tuple[torch.Tensor, KV]:
        """x [n, 1, h] -> (x [n, 1, h], this layer's (k, v) of the n tokens); see `MoTAttention.forward`."""
        h = route(x, gen_mask, self.input_layernorm, self.input_layernorm_gen)
        h, kv = self.self_attention(h, rope, gen_mask, prefix, causal, shard)
        x = x + h
        h = route(x, gen_mask, self.pre_mlp_layernorm, self.pre_mlp_layernorm_gen)
        h = route(h, gen_mask, lambda t: _first(self.mlp(t)), lambda t: _first(self.mlp_gen(t)))
        return x + h, kv
