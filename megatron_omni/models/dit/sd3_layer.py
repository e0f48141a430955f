"""One SD3 / SD3.5 MMDiT block (diffusers' `JointTransformerBlock`) as Megatron-Core modules, sequence-first.

Same joint attention as the Qwen-Image block (`layer.MMDiTLayer`: per-stream adaLN-Zero, fused QKV with
per-head QK RMSNorm, one softmax over [text; image], GELU-tanh MLPs, the same tensor-parallel split) with
SD3's differences:
- no rotary embedding (positions enter once, through the patch embedding's 2-D sincos table);
- dual attention (SD3.5-M's first blocks, `dual_attention_layers`): a second self-attention over the image
  tokens alone (`attn2`), modulated by three more adaLN outputs (9 x hidden: diffusers' `SD35AdaLayerNormZeroX`,
  chunked shift, scale, gate, shift_mlp, scale_mlp, gate_mlp, shift2, scale2, gate2);
- `context_pre_only` (the last block): the text stream's norm is `AdaLayerNormContinuous` (2 x hidden, chunked
  scale, shift) and the stream has no output projection or MLP; its attention output is dropped.

Context parallelism (Ulysses x ring, `context_parallel`): the image stream holds this CP rank's contiguous shard of
image tokens, the text stream the whole prompt on every CP rank, as in the Qwen-Image block. The joint attention then
goes through `context_parallel.joint_attention` ([text; image] key order) and the dual blocks' image-only attention
through `context_parallel.self_attention`; the pre-only block skips its text queries there (nothing reads them).
Without CP the block keeps diffusers' [image; text] order (`_joint_attention`), which its bf16 parity relies on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import nn

from megatron_omni.models.dit.context_parallel import joint_attention, self_attention
from megatron_omni.models.dit.layer import MMDiTLayerSubmodules, MMDiTStreamSubmodules, _modulate
from megatron_omni.models.dit.sd3_config import SD3Config


class SD3Stream(MegatronModule):
    """One stream's parameters: adaLN (`mod_chunks` x hidden outputs; None: none, the image's second attention),
    fused QKV with QK norms, the output projection (`has_proj=False`: the pre-only text stream) and the MLP
    (`mlp=False`: the pre-only text stream and the image's second attention)."""

    def __init__(self, config: SD3Config, submodules: MMDiTStreamSubmodules, tp_group: dist.ProcessGroup,
                 mod_chunks: int | None, has_proj: bool = True, mlp: bool = True):
        super().__init__(config)
        h = config.hidden_size
        d = config.kv_channels
        common = dict(config=config, init_method=config.init_method, bias=True, skip_bias_add=False,
                      tp_group=tp_group, is_expert=False)
        out_common = dict(common, init_method=config.output_layer_init_method)
        if mod_chunks:
            self.adaln = build_module(submodules.adaln, h, mod_chunks * h, gather_output=True, **common)
        self.linear_qkv = build_module(submodules.linear_qkv, h, 3 * h, gather_output=False, **common)
        norm = dict(eps=config.norm_eps, dtype=config.params_dtype)
        self.q_layernorm = build_module(submodules.q_layernorm, d, **norm)
        self.k_layernorm = build_module(submodules.k_layernorm, d, **norm)
        if has_proj:
            self.linear_proj = build_module(submodules.linear_proj, h, h, input_is_parallel=True, **out_common)
        if mlp:
            self.linear_fc1 = build_module(submodules.linear_fc1, h, config.ffn_hidden_size, gather_output=False,
                                           **common)
            self.linear_fc2 = build_module(submodules.linear_fc2, config.ffn_hidden_size, h,
                                           input_is_parallel=True, **out_common)

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """temb [b, h] -> the adaLN chunks, each [1, b, h]."""
        mod, _ = self.adaln(nn.functional.silu(temb))
        return tuple(m.unsqueeze(0) for m in mod.chunk(mod.shape[-1] // self.config.hidden_size, dim=-1))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [s, b, h] -> q, k, v [s, b, n_local, d], q and k RMS-normalised per head."""
        mixed, _ = self.linear_qkv(x)
        d = self.config.kv_channels
        q, k, v = mixed.unflatten(-1, (-1, 3 * d)).split(d, dim=-1)  # Megatron's per-head [q_h | k_h | v_h]
        return self.q_layernorm(q), self.k_layernorm(k), v.contiguous()

    def project(self, attn: torch.Tensor) -> torch.Tensor:
        """Attention output [b, s, n_local * d] (batch-first, see `_joint_attention`) -> [s, b, h] (row-parallel,
        reduced over tp)."""
        out, _ = self.linear_proj(attn)
        return out.transpose(0, 1)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(nn.functional.gelu(h, approximate="tanh"))
        return out


def _joint_attention(q_i, k_i, v_i, q_t, k_t, v_t) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One softmax over [image; text] keys, inputs [s, b, n, d]; q_t = k_t = v_t = None: image
    self-attention. Returns (image out, text out or None), batch-first [b, s, n * d]: slices of one
    [b, s_img + s_txt, n * d] tensor.

    Image first and the outputs as those slices, as diffusers' `JointAttnProcessor2_0` has them: the same key
    order makes the bf16 kernel's sums diffusers', and a linear over such a strided slice takes another CPU
    GEMM path (one bf16 ulp apart from a contiguous input), so the output projections see the same layout."""
    def bnsd(*parts):
        return torch.cat([t.permute(1, 2, 0, 3) for t in parts if t is not None], dim=2)

    out = nn.functional.scaled_dot_product_attention(bnsd(q_i, q_t), bnsd(k_i, k_t), bnsd(v_i, v_t))
    out = out.transpose(1, 2).flatten(-2)
    s_img = q_i.shape[0]
    return out[:, :s_img], (None if q_t is None else out[:, s_img:])


class SD3Layer(MegatronModule):
    """One SD3 block: `(img [s_i, b, h], txt [s_t, b, h], temb [b, h]) -> (img, txt or None)`.

    `layer_number` is 1-based and global; the block is dual-attention when `layer_number - 1` is in
    `config.dual_attention_layers` and context-pre-only (returns txt None) when it is the model's last."""

    def __init__(self, config: SD3Config, submodules: MMDiTLayerSubmodules, layer_number: int,
                 pg_collection: ProcessGroupCollection, ulysses_group: dist.ProcessGroup | None = None,
                 ring_group: dist.ProcessGroup | None = None):
        super().__init__(config)
        self.layer_number = layer_number
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        self.context_parallel = ulysses_group is not None or ring_group is not None
        self.dual = (layer_number - 1) in tuple(config.dual_attention_layers)
        self.context_pre_only = layer_number == config.num_layers
        tp = pg_collection.tp
        self.img = SD3Stream(config, submodules.img, tp, 9 if self.dual else 6)
        if self.dual:
            self.img_attn2 = SD3Stream(config, submodules.img, tp, None, mlp=False)
        pre_only = self.context_pre_only
        self.txt = SD3Stream(config, submodules.txt, tp, 2 if pre_only else 6, has_proj=not pre_only,
                             mlp=not pre_only)

    def forward(self, img: torch.Tensor, txt: torch.Tensor,
                temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """img [s_i, b, h], txt [s_t, b, h], temb [b, h] -> (img [s_i, b, h], txt [s_t, b, h] or None)."""
        eps = self.config.norm_eps
        i_mod = self.img.modulation(temb)
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = i_mod[:6]
        img_ln = nn.functional.layer_norm(img, img.shape[-1:], eps=eps)
        img_normed = img_ln * (1 + i_scale1) + i_shift1
        if self.context_pre_only:
            t_scale1, t_shift1 = self.txt.modulation(temb)
        else:
            t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt.modulation(temb)
        txt_normed = _modulate(txt, t_shift1, t_scale1, eps)

        q_i, k_i, v_i = self.img.qkv(img_normed)
        # The pre-only block's text queries feed nothing, but diffusers computes them: the image output is then
        # the same strided slice whose projection rounds as diffusers' does in bf16 (`_joint_attention`).
        q_t, k_t, v_t = self.txt.qkv(txt_normed)
        if self.context_parallel:
            out_t, out_i = joint_attention(None if self.context_pre_only else q_t, k_t, v_t, q_i, k_i, v_i, None,
                                           ulysses_group=self.ulysses_group, ring_group=self.ring_group)
            out_i = out_i.flatten(-2).transpose(0, 1)  # batch-first, as `project` takes it
            out_t = None if out_t is None else out_t.flatten(-2).transpose(0, 1)
        else:
            out_i, out_t = _joint_attention(q_i, k_i, v_i, q_t, k_t, v_t)
        img = img + i_gate1 * self.img.project(out_i)
        if self.dual:
            shift3, scale3, gate3 = i_mod[6:]
            q2, k2, v2 = self.img_attn2.qkv(img_ln * (1 + scale3) + shift3)
            if self.context_parallel:
                out2 = self_attention(q2, k2, v2, ulysses_group=self.ulysses_group, ring_group=self.ring_group)
                out2 = out2.flatten(-2).transpose(0, 1)
            else:
                out2 = _joint_attention(q2, k2, v2, None, None, None)[0]
            img = img + gate3 * self.img_attn2.project(out2)
        img = img + i_gate2 * self.img.mlp(_modulate(img, i_shift2, i_scale2, eps))
        if self.context_pre_only:
            return img, None
        txt = txt + t_gate1 * self.txt.project(out_t)
        txt = txt + t_gate2 * self.txt.mlp(_modulate(txt, t_shift2, t_scale2, eps))
        return img, txt
