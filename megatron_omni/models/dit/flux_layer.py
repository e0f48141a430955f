"""FLUX.1's single-stream block (diffusers' `FluxSingleTransformerBlock`) as Megatron-Core modules, sequence-first.

FLUX's double-stream blocks are the MMDiT block of Qwen-Image (`layer.MMDiTLayer`: per-stream adaLN-Zero with the
same chunk order, fused QKV with per-head QK RMSNorm and RoPE, one softmax over [text; image], GELU-tanh MLPs),
built with torch's `nn.RMSNorm` for the QK norms as diffusers' `FluxAttention` has them. The single-stream block
runs on the joined sequence [text; image]: one adaLN (3 x hidden: shift, scale, gate), attention (fused QKV with QK
norms and RoPE, no output projection of its own) beside a GELU-tanh MLP input projection (`proj_mlp`), and one output
projection over [attention | MLP] (`proj_out`, 5 x hidden inputs), gated, added to the residual.

Tensor parallelism: QKV and the MLP input projection are column-parallel (this rank's heads, its quarter of the MLP);
the output projection is column-parallel over its *output* with both activations all-gathered over tp first. So its
Megatron weight keeps diffusers' layout `[hidden, hidden + 4 hidden]` (a plain copy in conversion and the bridge,
tp-independent), and each output row is one sum over all 5 hidden inputs as in diffusers; the price is an all-gather
of `5 hidden / tp` activations per token and one of the `hidden / tp` outputs instead of one all-reduce of hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from megatron_omni.models.dit.context_parallel import joint_attention
from megatron_omni.models.dit.embeddings import apply_interleaved_rope
from megatron_omni.models.dit.flux_config import FluxConfig
from megatron_omni.models.dit.layer import _modulate


@dataclass
class FluxSingleSubmodules:
    """Which classes build one single-stream block. `adaln` and `linear_out` must gather their output (a
    Megatron-Core column-parallel linear: TE's cannot)."""

    adaln: ModuleSpec | type = None
    linear_qkv: ModuleSpec | type = None
    q_layernorm: ModuleSpec | type = None
    k_layernorm: ModuleSpec | type = None
    linear_fc1: ModuleSpec | type = None
    linear_out: ModuleSpec | type = None


class FluxSingleLayer(MegatronModule):
    """One single-stream block: `(img [s_i, b, h], txt [s_t, b, h], temb [b, h], img_rope, txt_rope) -> (img, txt)`,
    computed on the joined sequence [txt; img]."""

    def __init__(self, config: FluxConfig, submodules: FluxSingleSubmodules, layer_number: int,
                 tp_group: dist.ProcessGroup, ulysses_group: dist.ProcessGroup | None = None,
                 ring_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(config)
        self.layer_number = layer_number
        self.tp_group = tp_group
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        h, d = config.hidden_size, config.kv_channels
        common = dict(config=config, init_method=config.init_method, bias=True, skip_bias_add=False,
                      tp_group=tp_group, is_expert=False)
        self.adaln = build_module(submodules.adaln, h, 3 * h, gather_output=True, **common)
        self.linear_qkv = build_module(submodules.linear_qkv, h, 3 * h, gather_output=False, **common)
        norm = dict(eps=config.norm_eps, dtype=config.params_dtype)
        self.q_layernorm = build_module(submodules.q_layernorm, d, **norm)
        self.k_layernorm = build_module(submodules.k_layernorm, d, **norm)
        self.linear_fc1 = build_module(submodules.linear_fc1, h, config.ffn_hidden_size, gather_output=False, **common)
        self.linear_out = build_module(submodules.linear_out, h + config.ffn_hidden_size, h, gather_output=True,
                                       **dict(common, init_method=config.output_layer_init_method))

    def forward(self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, img_rope: torch.Tensor,
                txt_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """img [s_i, b, h], txt [s_t, b, h], temb [b, h]; rope [s, d/2] complex rotations of each stream -> the
        updated (img, txt)."""
        s_t = txt.shape[0]
        x = torch.cat([txt, img], dim=0)
        mod, _ = self.adaln(nn.functional.silu(temb))
        shift, scale, gate = (m.unsqueeze(0) for m in mod.chunk(3, dim=-1))
        normed = _modulate(x, shift, scale, self.config.norm_eps)
        mlp, _ = self.linear_fc1(normed)
        mlp = nn.functional.gelu(mlp, approximate="tanh")

        mixed, _ = self.linear_qkv(normed)
        d = self.config.kv_channels
        q, k, v = mixed.unflatten(-1, (-1, 3 * d)).split(d, dim=-1)  # Megatron's per-head [q_h | k_h | v_h]
        rope = torch.cat([txt_rope, img_rope], dim=0)
        q = apply_interleaved_rope(self.q_layernorm(q), rope)
        k = apply_interleaved_rope(self.k_layernorm(k), rope)
        v = v.contiguous()
        out_t, out_i = joint_attention(q[:s_t], k[:s_t], v[:s_t], q[s_t:], k[s_t:], v[s_t:], None,
                                       ulysses_group=self.ulysses_group, ring_group=self.ring_group)
        attn = torch.cat([out_t, out_i], dim=0).flatten(-2)
        if self.tp_group.size() > 1:
            attn = gather_from_tensor_model_parallel_region(attn, group=self.tp_group)
            mlp = gather_from_tensor_model_parallel_region(mlp, group=self.tp_group)
        out, _ = self.linear_out(torch.cat([attn, mlp], dim=-1))
        x = x + gate * out
        return x[s_t:], x[:s_t]
