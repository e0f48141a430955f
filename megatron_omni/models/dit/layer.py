"""One dual-stream MMDiT block as Megatron-Core modules, sequence-first `[s, b, h]`.

Each stream (image, text) has its own adaLN modulation, fused QKV with per-head QK RMSNorm, attention
output projection and GELU-tanh MLP; both streams meet in one softmax attention over [text; image].

Tensor parallelism: QKV and fc1 are column-parallel, the output projection and fc2 row-parallel, so each
rank holds `heads / tp` heads of both streams. The adaLN linear (6 x hidden outputs per stream, about a
third of all parameters) is column-parallel with its output gathered: its weight memory is split across
tp ranks and only a `[b, 6h]` vector is gathered per block. QK-norm weights are replicated; Megatron-Core's
finalize_model_grads sums their grads over tp (it recognises the `q_layernorm`/`k_layernorm` names).

Context parallelism: the image stream holds this rank's shard of image tokens, the text stream the full
(short) prompt on every CP rank; `joint_attention` does the Ulysses all-to-all and the ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn

from megatron_omni.models.dit.config import MMDiTConfig
from megatron_omni.models.dit.context_parallel import joint_attention
from megatron_omni.models.dit.embeddings import apply_interleaved_rope


@dataclass
class MMDiTStreamSubmodules:
    """Which classes build one stream of a block (the layer spec)."""

    adaln: ModuleSpec | type = None
    linear_qkv: ModuleSpec | type = None
    q_layernorm: ModuleSpec | type = None
    k_layernorm: ModuleSpec | type = None
    linear_proj: ModuleSpec | type = None
    linear_fc1: ModuleSpec | type = None
    linear_fc2: ModuleSpec | type = None


@dataclass
class MMDiTLayerSubmodules:
    img: MMDiTStreamSubmodules = field(default_factory=MMDiTStreamSubmodules)
    txt: MMDiTStreamSubmodules = field(default_factory=MMDiTStreamSubmodules)


def _init(config: MMDiTConfig):
    return config.init_method


class MMDiTStream(MegatronModule):
    """The parameters of one stream of one block; the block drives them."""

    def __init__(self, config: MMDiTConfig, submodules: MMDiTStreamSubmodules, tp_group: dist.ProcessGroup):
        super().__init__(config)
        h = config.hidden_size
        head_dim = config.kv_channels
        common = dict(config=config, init_method=config.init_method, bias=True, skip_bias_add=False,
                      tp_group=tp_group, is_expert=False)
        self.adaln = build_module(submodules.adaln, h, 6 * h, gather_output=True, **common)
        self.linear_qkv = build_module(submodules.linear_qkv, h, 3 * h, gather_output=False, **common)
        norm = dict(eps=config.norm_eps, dtype=config.params_dtype)
        self.q_layernorm = build_module(submodules.q_layernorm, head_dim, **norm)
        self.k_layernorm = build_module(submodules.k_layernorm, head_dim, **norm)
        out_common = dict(common, init_method=config.output_layer_init_method)
        self.linear_proj = build_module(submodules.linear_proj, h, h, input_is_parallel=True, **out_common)
        self.linear_fc1 = build_module(submodules.linear_fc1, h, config.ffn_hidden_size, gather_output=False,
                                       **common)
        self.linear_fc2 = build_module(submodules.linear_fc2, config.ffn_hidden_size, h, input_is_parallel=True,
                                       **out_common)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """temb [b, h] -> six [1, b, h] tensors: shift1, scale1, gate1, shift2, scale2, gate2."""
        mod, _ = self.adaln(nn.functional.silu(temb))
        return tuple(m.unsqueeze(0) for m in mod.chunk(6, dim=-1))

    def qkv(self, x: torch.Tensor, rope: torch.Tensor,
            queries: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x [s, b, h], rope [s, d/2] complex rotations -> q, k, v [s, b, n_local, d] with QK RMSNorm and
        RoPE applied; q is None when `queries` is False (keys and values only)."""
        mixed, _ = self.linear_qkv(x)
        d = self.config.kv_channels
        # Megatron's fused layout: per head [q_h | k_h | v_h].
        mixed = mixed.unflatten(-1, (-1, 3 * d))
        q, k, v = mixed.split(d, dim=-1)
        q = apply_interleaved_rope(self.q_layernorm(q), rope) if queries else None
        k = apply_interleaved_rope(self.k_layernorm(k), rope)
        return q, k, v.contiguous()

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(nn.functional.gelu(h, approximate="tanh"))
        return out


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return nn.functional.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale) + shift


class MMDiTLayer(MegatronModule):
    """One dual-stream block: `(img [s_i, b, h], txt [s_t, b, h]) -> (img, txt)`."""

    def __init__(
        self,
        config: MMDiTConfig,
        submodules: MMDiTLayerSubmodules,
        layer_number: int,
        pg_collection: ProcessGroupCollection,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number  # 1-based, global over pipeline stages (Megatron's convention)
        self.img = MMDiTStream(config, submodules.img, pg_collection.tp)
        self.txt = MMDiTStream(config, submodules.txt, pg_collection.tp)
        self.ulysses_group = ulysses_group
        self.ring_group = ring_group

    def _attention(self, img_normed, txt_normed, img_rope, txt_rope, txt_mask, text_output=True):
        q_i, k_i, v_i = self.img.qkv(img_normed, img_rope)
        q_t, k_t, v_t = self.txt.qkv(txt_normed, txt_rope, queries=text_output)
        out_t, out_i = joint_attention(
            q_t, k_t, v_t, q_i, k_i, v_i, txt_mask, ulysses_group=self.ulysses_group, ring_group=self.ring_group
        )
        return out_i.flatten(-2), None if out_t is None else out_t.flatten(-2)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        temb: torch.Tensor,
        img_rope: torch.Tensor,
        txt_rope: torch.Tensor,
        txt_mask: torch.Tensor | None,
        cond_temb: torch.Tensor | None = None,
        cond_tokens: torch.Tensor | None = None,
        text_output: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """img [s_i, b, h] (this CP rank's shard), txt [s_t, b, h], temb [b, h]; rope [s, d/2] complex
        rotations (`embeddings.rope_rotations`);
        txt_mask [b, s_t] bool (True = valid) -> updated (img, txt).

        text_output=False returns (img, None): the model's last block, whose text stream nothing reads,
        skips that stream's queries (its text keys and values still feed the image queries), output
        projection and MLP (most of the block's work when prompts are longer than the image sequence).
        Those parameters get no gradient either way.

        cond_temb [b, h] and cond_tokens [s_i] bool (`zero_cond_t`): the image tokens marked True (conditioning
        images) are modulated with `cond_temb` (the timestep-0 embedding) instead of `temb`."""
        eps = self.config.norm_eps
        i_mods = self.img.modulation(temb)
        if cond_temb is not None:
            pick = cond_tokens.view(-1, 1, 1)
            i_mods = tuple(torch.where(pick, c, m) for c, m in zip(self.img.modulation(cond_temb), i_mods))
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = i_mods
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt.modulation(temb)

        img_normed = _modulate(img, i_shift1, i_scale1, eps)
        txt_normed = _modulate(txt, t_shift1, t_scale1, eps)
        if self.config.recompute_granularity == "selective":
            from megatron.core import tensor_parallel

            # The flag is bound, not passed: the checkpoint saves its positional args with save_for_backward.
            attention = functools.partial(self._attention, text_output=text_output)
            attn_img, attn_txt = tensor_parallel.checkpoint(
                attention, False, img_normed, txt_normed, img_rope, txt_rope, txt_mask
            )
        else:
            attn_img, attn_txt = self._attention(img_normed, txt_normed, img_rope, txt_rope, txt_mask, text_output)
        attn_img, _ = self.img.linear_proj(attn_img)
        img = img + i_gate1 * attn_img
        img = img + i_gate2 * self.img.mlp(_modulate(img, i_shift2, i_scale2, eps))
        if not text_output:
            return img, None
        attn_txt, _ = self.txt.linear_proj(attn_txt)
        txt = txt + t_gate1 * attn_txt
        txt = txt + t_gate2 * self.txt.mlp(_modulate(txt, t_shift2, t_scale2, eps))
        return img, txt
