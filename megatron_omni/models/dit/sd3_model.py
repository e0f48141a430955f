"""SD3 / SD3.5's MMDiT (diffusers' `SD3Transformer2DModel`) as a Megatron-Core model with tensor parallelism.

The first blocks of SD3.5-M carry a second image self-attention (`sd3_layer.SD3Layer`); the last block's text
stream is context-pre-only. Conditioning is diffusers' `CombinedTimestepTextProjEmbeddings`: the timestep MLP
of sinusoidal features of t (t = 1000 sigma, as the SD3 pipeline passes it) plus an MLP of the pooled CLIP
embedding. Blocks, norm and head run sequence-first `[s, b, h]` like the Qwen-Image model (`model.MMDiTModel`).

This slice holds the whole model on every rank (pp = 1, no context parallelism); `DiTStage` gives the process
groups and the names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.embeddings import get_2d_sincos_pos_embed
from torch import nn

from megatron_omni.algorithms.schedule import NUM_TRAIN_TIMESTEPS
from megatron_omni.models.dit.embeddings import TimestepEmbedder
from megatron_omni.models.dit.layer import MMDiTLayerSubmodules
from megatron_omni.models.dit.model import DiTBatch, DiTStage, _AdaNormOut
from megatron_omni.models.dit.sd3_config import SD3Config
from megatron_omni.models.dit.sd3_interface import pack_image_latents, unpack_image_latents
from megatron_omni.models.dit.sd3_layer import SD3Layer


@dataclass
class SD3Batch:
    """One micro-batch in diffusers' `SD3Transformer2DModel.forward` layout.

    latents: [b, in_channels, H, W] (H, W multiples of patch_size)
    prompt_embeds: [b, s_txt, joint_attention_dim]
    pooled: [b, pooled_projection_dim] pooled CLIP embeddings
    timestep: [b] t in [0, 1000] (the pipeline's scheduler timestep, 1000 sigma)
    """

    latents: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled: torch.Tensor
    timestep: torch.Tensor


class PooledEmbedder(nn.Module):
    """pooled [b, p] -> [b, hidden]: Linear, SiLU, Linear (diffusers' `PixArtAlphaTextProjection(act_fn="silu")`),
    replicated on every rank like the timestep embedder."""

    def __init__(self, pooled_dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(pooled_dim, hidden, dtype=dtype)
        self.linear_2 = nn.Linear(hidden, hidden, dtype=dtype)
        for p in self.parameters():
            p.pipeline_parallel = True

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear_2(nn.functional.silu(self.linear_1(pooled)))


class PatchEmbed(nn.Module):
    """latents [b, c, H, W] -> tokens [b, (H/p)*(W/p), hidden] plus the centre crop of the fixed sincos table
    (`pos_embed` [1, m*m, hidden], a persistent buffer as in diffusers' `PatchEmbed`, m = pos_embed_max_size)."""

    def __init__(self, config: SD3Config) -> None:
        super().__init__()
        p, h, m = config.patch_size, config.hidden_size, config.pos_embed_max_size
        self.patch_size, self.max_size = p, m
        self.proj = nn.Conv2d(config.in_channels, h, kernel_size=p, stride=p, dtype=config.params_dtype)
        table = get_2d_sincos_pos_embed(h, m, base_size=config.sample_size // p, interpolation_scale=1,
                                        output_type="pt")
        # In the parameters' dtype, as diffusers' `from_pretrained(torch_dtype=...)` casts this buffer too.
        self.register_buffer("pos_embed", table.float().unsqueeze(0).to(config.params_dtype), persistent=True)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        hh, ww = (n // self.patch_size for n in latents.shape[-2:])
        if max(hh, ww) > self.max_size:
            raise ValueError(f"latent grid {hh}x{ww} patches exceeds pos_embed_max_size {self.max_size}")
        top, left = (self.max_size - hh) // 2, (self.max_size - ww) // 2
        pos = self.pos_embed.reshape(1, self.max_size, self.max_size, -1)[:, top:top + hh, left:left + ww]
        x = self.proj(latents).flatten(2).transpose(1, 2)
        return (x + pos.reshape(1, hh * ww, -1)).to(x.dtype)


class SD3Model(DiTStage):
    """The whole SD3 MMDiT on this rank's tensor-parallel shard: `forward(SD3Batch) -> velocity [b, c, H, W]`, or
    `forward(DiTBatch)` (the trainer's and the rollout's packed form: latents [b, S, c p p] patch tokens, sigma,
    grid, pooled) -> velocity tokens [b, S, c p p] (`sd3_interface`)."""

    def __init__(self, config: SD3Config, layer_spec: MMDiTLayerSubmodules, groups) -> None:
        super().__init__(config, groups, True, True)
        if groups.mcore.pp.size() > 1 or self.cp_group.size() > 1:
            raise ValueError("the SD3 model supports tensor parallelism only so far (pp = cp = 1)")
        h, dtype = config.hidden_size, config.params_dtype
        self.time_embedder = TimestepEmbedder(h, config.timestep_channels, dtype=dtype, scale=1.0,
                                              round_timestep=False)
        self.pooled_embedder = PooledEmbedder(config.pooled_projection_dim, h, dtype)
        self.patch_embed = PatchEmbed(config)
        self.context_embedder = nn.Linear(config.joint_attention_dim, h, dtype=dtype)
        self.layers = nn.ModuleList(SD3Layer(config, layer_spec, i + 1, self.pg_collection)
                                    for i in range(config.num_layers))
        self.norm_out = _AdaNormOut(h, config.norm_eps, dtype=dtype)
        self.proj_out = nn.Linear(h, config.patch_size**2 * config.out_channels, dtype=dtype)

    def forward(self, batch: SD3Batch | DiTBatch) -> torch.Tensor:
        if isinstance(batch, DiTBatch):
            if batch.pooled is None:
                raise ValueError("the SD3 model needs the pooled CLIP embeddings (DiTBatch.pooled)")
            p = self.config.patch_size
            image = unpack_image_latents(batch.latents, batch.grid, p)
            out = self.forward(SD3Batch(image, batch.prompt_embeds, batch.pooled,
                                        batch.sigma.float() * NUM_TRAIN_TIMESTEPS))
            return pack_image_latents(out, p)
        dtype = self.config.params_dtype
        b, _, big_h, big_w = batch.latents.shape
        p = self.config.patch_size
        temb = self.time_embedder(batch.timestep, dtype) + self.pooled_embedder(batch.pooled.to(dtype))
        # Contiguous sequence-first copies: a linear over a transposed view runs another CPU GEMM path whose bf16
        # results differ from diffusers' by an ulp.
        img = self.patch_embed(batch.latents.to(dtype)).transpose(0, 1).contiguous()
        txt = self.context_embedder(batch.prompt_embeds.to(dtype)).transpose(0, 1).contiguous()
        for i, layer in enumerate(self.layers):
            if self.recompute_block(i):
                from megatron.core import tensor_parallel

                img, txt = tensor_parallel.checkpoint(layer, False, img, txt, temb)
            else:
                img, txt = layer(img, txt, temb)
        out = self.proj_out(self.norm_out(img, temb)).transpose(0, 1)  # [b, s, p*p*c]
        hh, ww, c = big_h // p, big_w // p, self.config.out_channels
        out = out.reshape(b, hh, ww, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, c, hh * p, ww * p)
