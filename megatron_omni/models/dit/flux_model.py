"""FLUX.1's transformer (diffusers' `FluxTransformer2DModel`) as a Megatron-Core model with tensor parallelism.

`num_layers` double-stream blocks (the MMDiT block, `layer.MMDiTLayer`) then `num_single_layers` single-stream
blocks (`flux_layer.FluxSingleLayer`) over [text; image], all with FLUX's 3-axis RoPE (`embeddings.flux_rope_angles`).
Conditioning is diffusers' `CombinedTimestepGuidanceTextProjEmbeddings` (guidance-distilled models such as
FLUX.1-dev) or `CombinedTimestepTextProjEmbeddings`: an MLP of sinusoidal features of t = 1000 sigma (rounded to the
compute dtype first, as diffusers does), plus one of 1000 x the guidance scale, plus an MLP of the pooled CLIP
embedding. Blocks, norm and head run sequence-first `[s, b, h]`.

Parallelism as the Qwen-Image model has it (`DiTStage`): tensor parallelism in the blocks; context parallelism over
the image tokens (each CP rank keeps its contiguous shard of the packed latent tokens and the matching rows of the
image RoPE table; the prompt, its RoPE rows and the text part of every single block's [text; image] stay whole on
every CP rank; both block kinds attend through `context_parallel.joint_attention`); pipeline parallelism over all
`num_layers + num_single_layers` blocks in model order, so the double -> single transition falls inside a stage or
at a stage boundary (the first stage owns `x_embedder` / `context_embedder`, the last `norm_out` / `proj_out`, every
stage the timestep, guidance and pooled embedders). Between stages travels `[s_txt + s_img_local, b, h]`, the
single blocks' [text; image] split as the double blocks' two streams are.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_omni.algorithms.schedule import NUM_TRAIN_TIMESTEPS
from megatron_omni.models.dit.embeddings import TimestepEmbedder, flux_rope_angles, rope_rotations
from megatron_omni.models.dit.flux_config import FluxConfig
from megatron_omni.models.dit.flux_layer import FluxSingleLayer, FluxSingleSubmodules
from megatron_omni.models.dit.layer import MMDiTLayer, MMDiTLayerSubmodules
from megatron_omni.models.dit.model import DiTBatch, DiTStage, _AdaNormOut
from megatron_omni.models.dit.sd3_model import PooledEmbedder


class FluxModel(DiTStage):
    """The whole FLUX transformer on this rank's tensor-parallel shard: `forward(DiTBatch) -> velocity [b, s_img,
    p p out]`. The batch carries the packed latents [b, s_img, in_channels] (FLUX's 2x2 packing, on patch grid
    `grid = (1, h, w)`), the T5 states [b, s_txt, joint_attention_dim], sigma [b], the pooled CLIP embedding
    `pooled` [b, pooled_projection_dim] and, for a guidance-distilled model, `guidance` [b] (the guidance scale)."""

    def __init__(self, config: FluxConfig, layer_spec: tuple[MMDiTLayerSubmodules, FluxSingleSubmodules],
                 groups) -> None:
        super().__init__(config, groups, num_blocks=config.num_layers + config.num_single_layers)
        double_spec, single_spec = layer_spec
        # This stage's blocks [layer_offset, layer_offset + num_stage_layers) in model order: doubles, then singles.
        start, stop = self.layer_offset, self.layer_offset + self.num_stage_layers
        doubles = range(start, min(stop, config.num_layers))
        singles = range(max(start, config.num_layers) - config.num_layers, max(stop - config.num_layers, 0))
        self.double_offset, self.single_offset = doubles.start, singles.start
        h, dtype = config.hidden_size, config.params_dtype
        pg = self.pg_collection
        # t = 1000 sigma enters as given (diffusers multiplies in the compute dtype; see `forward`).
        self.time_embedder = TimestepEmbedder(h, config.timestep_channels, dtype=dtype, scale=1.0,
                                              round_timestep=False)
        if config.guidance_embeds:
            self.guidance_embedder = TimestepEmbedder(h, config.timestep_channels, dtype=dtype, scale=1.0,
                                                      round_timestep=False)
        self.pooled_embedder = PooledEmbedder(config.pooled_projection_dim, h, dtype)
        if self.pre_process:
            self.x_embedder = nn.Linear(config.in_channels, h, dtype=dtype)
            self.context_embedder = nn.Linear(config.joint_attention_dim, h, dtype=dtype)
        self.layers = nn.ModuleList(MMDiTLayer(config, double_spec, i + 1, pg, self.ulysses_group, self.ring_group)
                                    for i in doubles)
        self.single_layers = nn.ModuleList(
            FluxSingleLayer(config, single_spec, config.num_layers + i + 1, pg.tp, self.ulysses_group,
                            self.ring_group)
            for i in singles)
        if self.post_process:
            self.norm_out = _AdaNormOut(h, config.norm_eps, dtype=dtype)
            self.proj_out = nn.Linear(h, config.patch_size**2 * config.out_channels, dtype=dtype)

    def global_name(self, local: str) -> str:
        """The model-wide name of one of this stage's tensors: its double block i is `layers.{double_offset + i}`,
        its single block j `single_layers.{single_offset + j}`."""
        for prefix, offset in (("layers.", self.double_offset), ("single_layers.", self.single_offset)):
            if local.startswith(prefix):
                idx, _, rest = local[len(prefix):].partition(".")
                return f"{prefix}{int(idx) + offset}" + (f".{rest}" if rest else "")
        return local

    def conditioning(self, sigma: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        """sigma [b], pooled [b, P], guidance [b] or None -> temb [b, h] (diffusers' rounding: t and the guidance
        scale times 1000 in the compute dtype, their embeddings summed before the pooled one is added)."""
        dtype = self.config.params_dtype
        temb = self.time_embedder(sigma.to(dtype) * NUM_TRAIN_TIMESTEPS, dtype)
        if self.config.guidance_embeds:
            if guidance is None:
                raise ValueError("a guidance-distilled FLUX model (guidance_embeds) needs the guidance scale "
                                 "(DiTBatch.guidance)")
            temb = temb + self.guidance_embedder(guidance.to(dtype) * NUM_TRAIN_TIMESTEPS, dtype)
        return temb + self.pooled_embedder(pooled.to(dtype))

    def forward(self, batch: DiTBatch) -> torch.Tensor:
        if batch.pooled is None:
            raise ValueError("the FLUX model needs the pooled CLIP embeddings (DiTBatch.pooled)")
        f, hh, ww = batch.grid
        if f != 1 or batch.cond_grids:
            raise ValueError(f"FLUX generates one image: patch grid (1, h, w) and no conditions, got {batch.grids}")
        shard = self.image_shard(hh * ww)
        dtype = self.config.params_dtype
        temb = self.conditioning(batch.sigma, batch.pooled, batch.guidance)
        if self.pre_process:
            if batch.latents.shape[1] != hh * ww:
                raise ValueError(f"latents carry {batch.latents.shape[1]} tokens but grid {batch.grid} has {hh * ww}")
            # Contiguous sequence-first copies: a linear over a transposed view takes another CPU GEMM path (bf16).
            img = self.x_embedder(batch.latents[:, shard].to(dtype)).transpose(0, 1).contiguous()
            txt = self.context_embedder(batch.prompt_embeds.to(dtype)).transpose(0, 1).contiguous()
        else:
            txt, img = self.stage_input(shard.stop - shard.start)
        img_angles, txt_angles = flux_rope_angles(hh, ww, txt.shape[0], tuple(self.config.axes_dims_rope),
                                                  self.config.rope_theta)
        img_rope = rope_rotations(img_angles[shard]).to(img.device)
        txt_rope = rope_rotations(txt_angles).to(img.device)
        blocks = [*self.layers, *self.single_layers]
        for i, layer in enumerate(blocks):
            args = (img, txt, temb, img_rope, txt_rope) + ((None,) if i < len(self.layers) else ())
            if self.recompute_block(i):
                from megatron.core import tensor_parallel

                img, txt = tensor_parallel.checkpoint(layer, False, *args)
            else:
                img, txt = layer(*args)
        if not self.post_process:
            return torch.cat([txt, img], dim=0)
        out = self.proj_out(self.norm_out(img, temb))
        return out.transpose(0, 1)  # [b, s_img_local, p*p*out]
