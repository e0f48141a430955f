"""One Wan DiT block (diffusers' `WanTransformerBlock`) as Megatron-Core modules, sequence-first `[s, b, h]`.

A block is self-attention over the video tokens (3D RoPE, q/k RMS-normalised across heads), cross-attention
from the video tokens to the text states (no RoPE, no mask: Wan attends to the zero-padded text as its
pipeline pads it), and a GELU-tanh MLP. Self-attention and MLP are modulated by the shared timestep
projection plus the block's own `scale_shift_table` `[1, 6, h]` (rows shift, scale, gate of the
self-attention, then of the MLP); cross-attention is not gated, its input is LayerNorm'd with affine weights
(diffusers' `cross_attn_norm=True`).

Tensor parallelism: q/k/v projections and fc1 column-parallel, the output projections and fc2
row-parallel, so each rank holds `heads / tp` heads of both attentions; the across-heads q/k norms
(`HeadsRMSNorm`) all-reduce their statistic over tp and hold the weight slice of their heads. The
modulation table and the cross-attention LayerNorm are replicated (they act on replicated activations, so
their grads are whole on every tp rank).

Context parallelism: the block holds this rank's shard of video tokens and the full text on every CP rank;
self-attention goes through `self_attention` (Ulysses all-to-all x ring), cross-attention is local (each
shard's queries against all text keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from megatron_omni.models.dit.config import WanConfig
from megatron_omni.models.dit.context_parallel import self_attention
from megatron_omni.models.dit.embeddings import apply_interleaved_rope
from megatron_omni.models.dit.norms import HeadsRMSNorm


@dataclass
class WanLayerSubmodules:
    """Which classes build a block's linears (the layer spec): every one is column- or row-parallel."""

    column: ModuleSpec | type = None
    row: ModuleSpec | type = None


def linear_kwargs(config: WanConfig, tp_group: dist.ProcessGroup, output: bool) -> dict:
    """The keyword arguments of a Megatron-Core parallel linear of the model (an output projection takes the
    output-layer init)."""
    init = config.output_layer_init_method if output else config.init_method
    return dict(config=config, init_method=init, bias=True, skip_bias_add=False, tp_group=tp_group, is_expert=False)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked softmax attention, `[s_q, b, n, d]` queries over `[s_k, b, n, d]` keys -> `[s_q, b, n, d]`."""
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3))
    return out.permute(2, 0, 1, 3)


class WanSelfAttention(MegatronModule):
    """Self-attention over the video tokens (diffusers' `attn1`): fused q/k/v, across-heads q/k RMSNorm,
    3D RoPE, context-parallel attention, output projection."""

    def __init__(self, config: WanConfig, submodules: WanLayerSubmodules, tp_group: dist.ProcessGroup,
                 ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None) -> None:
        super().__init__(config)
        h, tp = config.hidden_size, tp_group.size()
        self.linear_qkv = build_module(submodules.column, h, 3 * h, gather_output=False,
                                       **linear_kwargs(config, tp_group, False))
        self.norm_q = HeadsRMSNorm(h // tp, config.norm_eps, tp_group, config.params_dtype)
        self.norm_k = HeadsRMSNorm(h // tp, config.norm_eps, tp_group, config.params_dtype)
        self.linear_proj = build_module(submodules.row, h, h, input_is_parallel=True,
                                        **linear_kwargs(config, tp_group, True))
        self.ulysses_group, self.ring_group = ulysses_group, ring_group

    def qkv(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [s, b, h] -> q, k, v [s, b, n_local, d]: normalised across heads, q and k rotated."""
        d = self.config.kv_channels
        mixed, _ = self.linear_qkv(x)
        # Megatron's fused layout: per head [q_h | k_h | v_h].
        q, k, v = _heads(mixed, 3 * d).split(d, dim=-1)
        q = apply_interleaved_rope(_heads(self.norm_q(q.flatten(-2)), d), rope)
        k = apply_interleaved_rope(_heads(self.norm_k(k.flatten(-2)), d), rope)
        return q, k, v.contiguous()

    def core(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The projections and attention before the output projection: [s, b, h] -> [s, b, h / tp]."""
        q, k, v = self.qkv(x, rope)
        out = self_attention(q, k, v, ulysses_group=self.ulysses_group, ring_group=self.ring_group)
        return out.flatten(-2)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, recompute_core: bool = False) -> torch.Tensor:
        """x [s_local, b, h] (this CP rank's video shard), rope [s_local, d/2] complex -> [s_local, b, h]."""
        if recompute_core:
            out = tensor_parallel.checkpoint(self.core, False, x, rope)
        else:
            out = self.core(x, rope)
        return self.linear_proj(out)[0]


class WanCrossAttention(MegatronModule):
    """Cross-attention of the video tokens to the text states (diffusers' `attn2`): q from the video, k/v from
    the text, both q and k RMS-normalised across heads, no RoPE, no mask."""

    def __init__(self, config: WanConfig, submodules: WanLayerSubmodules, tp_group: dist.ProcessGroup) -> None:
        super().__init__(config)
        h, tp = config.hidden_size, tp_group.size()
        column = dict(gather_output=False, **linear_kwargs(config, tp_group, False))
        self.linear_q = build_module(submodules.column, h, h, **column)
        self.linear_k = build_module(submodules.column, h, h, **column)
        self.linear_v = build_module(submodules.column, h, h, **column)
        self.norm_q = HeadsRMSNorm(h // tp, config.norm_eps, tp_group, config.params_dtype)
        self.norm_k = HeadsRMSNorm(h // tp, config.norm_eps, tp_group, config.params_dtype)
        self.linear_proj = build_module(submodules.row, h, h, input_is_parallel=True,
                                        **linear_kwargs(config, tp_group, True))

    def core(self, x: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        """x [s, b, h], txt [s_txt, b, h] -> attention output [s, b, h / tp] before the output projection."""
        d = self.config.kv_channels
        q = _heads(self.norm_q(self.linear_q(x)[0]), d)
        k = _heads(self.norm_k(self.linear_k(txt)[0]), d)
        v = _heads(self.linear_v(txt)[0], d)
        return _sdpa(q, k, v).flatten(-2)

    def forward(self, x: torch.Tensor, txt: torch.Tensor, recompute_core: bool = False) -> torch.Tensor:
        """x [s_local, b, h], txt [s_txt, b, h] (whole on every CP rank) -> [s_local, b, h]."""
        if recompute_core:
            out = tensor_parallel.checkpoint(self.core, False, x, txt)
        else:
            out = self.core(x, txt)
        return self.linear_proj(out)[0]


class WanMLP(MegatronModule):
    """fc1 (column-parallel), GELU-tanh, fc2 (row-parallel): diffusers' `FeedForward(gelu-approximate)`."""

    def __init__(self, config: WanConfig, submodules: WanLayerSubmodules, tp_group: dist.ProcessGroup) -> None:
        super().__init__(config)
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.linear_fc1 = build_module(submodules.column, h, ffn, gather_output=False,
                                       **linear_kwargs(config, tp_group, False))
        self.linear_fc2 = build_module(submodules.row, ffn, h, input_is_parallel=True,
                                       **linear_kwargs(config, tp_group, True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, h]."""
        return self.linear_fc2(F.gelu(self.linear_fc1(x)[0], approximate="tanh"))[0]


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    # diffusers' FP32LayerNorm without affine weights, then the modulation in fp32, rounded once
    normed = F.layer_norm(x.float(), x.shape[-1:], eps=eps)
    return (normed * (1 + scale) + shift).to(x.dtype)


class WanLayer(MegatronModule):
    """One block: `(video [s_local, b, h], text [s_txt, b, h], timestep projection [b, 6, h] or per token
    [s_local, b, 6, h], rope) -> video`."""

    def __init__(
        self,
        config: WanConfig,
        submodules: WanLayerSubmodules,
        layer_number: int,
        pg_collection: ProcessGroupCollection,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.layer_number = layer_number  # 1-based, global over pipeline stages (Megatron's convention)
        tp = pg_collection.tp
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, h, dtype=config.params_dtype) / h**0.5)
        self.self_attention = WanSelfAttention(config, submodules, tp, ulysses_group, ring_group)
        self.norm2 = nn.LayerNorm(h, eps=config.norm_eps, elementwise_affine=True, dtype=config.params_dtype)
        self.cross_attention = WanCrossAttention(config, submodules, tp)
        self.mlp = WanMLP(config, submodules, tp)

    def forward(self, x: torch.Tensor, txt: torch.Tensor, temb_proj: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """x [s_local, b, h] (this CP rank's video shard), txt [s_txt, b, h], temb_proj [b, 6, h] (the model's
        timestep projection; [s_local, b, 6, h] with per-token timesteps), rope [s_local, d/2] complex rotations
        -> x [s_local, b, h]."""
        eps = self.config.norm_eps
        selective = self.config.recompute_granularity == "selective"
        # [b, 6, h] (or per token [s, b, 6, h]) -> six [1 | s, b, h] fp32 rows: shift, scale, gate (self-attention),
        # shift, scale, gate (MLP)
        temb_proj = temb_proj if temb_proj.ndim == 4 else temb_proj[None]
        mod = (self.scale_shift_table.float() + temb_proj.float()).movedim(2, 0)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(0)
        attn = self.self_attention(_modulate(x, shift1, scale1, eps), rope, recompute_core=selective)
        x = (x.float() + attn.float() * gate1).to(x.dtype)
        x = x + self.cross_attention(_layer_norm_fp32(self.norm2, x), txt, recompute_core=selective)
        ff = self.mlp(_modulate(x, shift2, scale2, eps))
        return (x.float() + ff.float() * gate2).to(x.dtype)


def _layer_norm_fp32(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """diffusers' FP32LayerNorm: statistics and affine weights in fp32, the result in x's dtype."""
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps).to(x.dtype)

