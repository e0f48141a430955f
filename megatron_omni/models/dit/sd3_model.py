"""SD3 / SD3.5's MMDiT (diffusers' `SD3Transformer2DModel`) as a Megatron-Core model with tensor parallelism.

The first blocks of SD3.5-M carry a second image self-attention (`sd3_layer.SD3Layer`); the last block's text
stream is context-pre-only. Conditioning is diffusers' `CombinedTimestepTextProjEmbeddings`: the timestep MLP
of sinusoidal features of t (t = 1000 sigma, as the SD3 pipeline passes it) plus an MLP of the pooled CLIP
embedding. Blocks, norm and head run sequence-first `[s, b, h]` like the Qwen-Image model (`model.MMDiTModel`).

Parallelism as the Qwen-Image model has it (`DiTStage`): tensor parallelism in the blocks; context parallelism over
the image tokens (each CP rank embeds the whole latent, keeps its contiguous shard of patch tokens, and its blocks
attend through `context_parallel`; the prompt stays whole on every CP rank); pipeline parallelism over the blocks
(the first stage owns the patch and context embedders, the last `norm_out` / `proj_out` and the context-pre-only
last block, every stage the timestep and pooled embedders; between stages travels `[s_txt + s_img_local, b, h]`).
Under CP or PP the model takes the packed `DiTBatch` only and its last stage returns this CP rank's velocity
tokens.
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
from megatron_omni.models.dit.sd3_interface import unpack_image_latents
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
        super().__init__(config, groups)
        h, dtype = config.hidden_size, config.params_dtype
        self.time_embedder = TimestepEmbedder(h, config.timestep_channels, dtype=dtype, scale=1.0,
                                              round_timestep=False)
        self.pooled_embedder = PooledEmbedder(config.pooled_projection_dim, h, dtype)
        if self.pre_process:
            self.patch_embed = PatchEmbed(config)
            self.context_embedder = nn.Linear(config.joint_attention_dim, h, dtype=dtype)
        self.layers = nn.ModuleList(
            SD3Layer(config, layer_spec, self.layer_offset + i + 1, self.pg_collection, self.ulysses_group,
                     self.ring_group)
            for i in range(self.num_stage_layers))
        if self.post_process:
            self.norm_out = _AdaNormOut(h, config.norm_eps, dtype=dtype)
            self.proj_out = nn.Linear(h, config.patch_size**2 * config.out_channels, dtype=dtype)

    def forward(self, batch: SD3Batch | DiTBatch) -> torch.Tensor:
        p, c = self.config.patch_size, self.config.out_channels
        if isinstance(batch, DiTBatch):
            if batch.pooled is None:
                raise ValueError("the SD3 model needs the pooled CLIP embeddings (DiTBatch.pooled)")
            _, hh, ww = batch.grid
            image = unpack_image_latents(batch.latents, batch.grid, p) if self.pre_process else None
            out = self._run(image, batch.prompt_embeds, batch.pooled, batch.sigma.float() * NUM_TRAIN_TIMESTEPS,
                            hh, ww)
            if not self.post_process:
                return out
            # Each token's outputs from proj_out's (ph, pw, c) order to the packed form's (c, ph, pw).
            return out.unflatten(-1, (p, p, c)).permute(0, 1, 4, 2, 3).flatten(2)
        if self.pg_collection.pp.size() > 1 or self.cp_group.size() > 1:
            raise ValueError("under pipeline or context parallelism the SD3 model takes the packed DiTBatch")
        b, _, big_h, big_w = batch.latents.shape
        hh, ww = big_h // p, big_w // p
        out = self._run(batch.latents, batch.prompt_embeds, batch.pooled, batch.timestep, hh, ww)
        out = out.reshape(b, hh, ww, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, c, hh * p, ww * p)

    def _run(self, latents: torch.Tensor | None, prompt_embeds: torch.Tensor | None, pooled: torch.Tensor,
             timestep: torch.Tensor, hh: int, ww: int) -> torch.Tensor:
        """latents [b, c, H, W] (first stage), prompt_embeds [b, s_txt, joint] (first stage), pooled [b, P],
        timestep [b] (1000 sigma), patch grid hh x ww -> this CP rank's output tokens [b, hh ww / cp, p p c] in
        proj_out's (ph, pw, c) order on the last stage, the hidden states [s_txt + hh ww / cp, b, h] elsewhere."""
        dtype = self.config.params_dtype
        shard = self.image_shard(hh * ww)
        temb = self.time_embedder(timestep, dtype) + self.pooled_embedder(pooled.to(dtype))
        if self.pre_process:
            # Contiguous sequence-first copies: a linear over a transposed view runs another CPU GEMM path whose
            # bf16 results differ from diffusers' by an ulp. Every CP rank embeds the whole latent (one linear per
            # patch: its shard's rows of it are the same numbers) and keeps its shard.
            img = self.patch_embed(latents.to(dtype)).transpose(0, 1)[shard].contiguous()
            txt = self.context_embedder(prompt_embeds.to(dtype)).transpose(0, 1).contiguous()
        else:
            txt, img = self.stage_input(shard.stop - shard.start)
        for i, layer in enumerate(self.layers):
            if self.recompute_block(i):
                from megatron.core import tensor_parallel

                img, txt = tensor_parallel.checkpoint(layer, False, img, txt, temb)
            else:
                img, txt = layer(img, txt, temb)
        if not self.post_process:
            return torch.cat([txt, img], dim=0)
        return self.proj_out(self.norm_out(img, temb)).transpose(0, 1)  # [b, s_local, p*p*c]
