"""The Wan video DiT (diffusers' `WanTransformer3DModel`, text-to-video) as a Megatron-Core model with TP, CP
(Ulysses x ring over the video tokens) and PP.

The model is built for one pipeline stage (`DiTStage`): the first stage owns the 3D patch embedding and the
text embedder, the last the output modulation table and `proj_out`, every stage its share of the blocks and a
replica of the timestep embedder and of the timestep projection (their grads are summed over stages by
Megatron-Core's `finalize_model_grads`; the projection, `6h` wide, is column-parallel with a gathered output,
so its weight splits over tp). Between stages the schedules pass `[s_txt + s_vid_local, b, h]`: the embedded
text (unchanged by the blocks, which only read it) followed by this CP rank's video shard.

Inputs are the MMDiT's `DiTBatch`: latents `[b, s, c * pt * ph * pw]` as packed 3D patches
(`embeddings.patchify_video`), the text states `[b, s_txt, text_dim]` (the mask is not read: Wan attends to the
zero-padded text as its pipeline pads it), sigma `[b]` in [0, 1] (or `[b, s]` per token: Wan2.2 TI2V's expanded
timesteps, the image-conditioned first frame's tokens at 0) and the patch grid (frames, height, width).
The timestep Wan's transformer reads is `t = 1000 sigma` in fp32. The output is the velocity packed the way
the latents are, `[b, s_local, c * pt * ph * pw]` on the last stage.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import build_module
from torch import nn

from megatron_omni.algorithms.schedule import NUM_TRAIN_TIMESTEPS
from megatron_omni.models.dit.config import WanConfig
from megatron_omni.models.dit.embeddings import TimestepEmbedder, rope_rotations, wan_rope_angles
from megatron_omni.models.dit.model import DiTBatch, DiTStage
from megatron_omni.models.dit.wan_layer import WanLayer, WanLayerSubmodules, linear_kwargs
from megatron_omni.parallel.linear import ColumnParallelLinear


class PatchEmbedding3D(nn.Module):
    """diffusers' `Conv3d(in, h, kernel=stride=patch)` on packed patches: one linear whose weight is the conv's
    `[h, c, pt, ph, pw]` (kept in that shape, so checkpoints and syncs copy it as it is)."""

    def __init__(self, in_channels: int, hidden: int, patch: tuple[int, int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, in_channels, *patch, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype))
        fan_in = in_channels * math.prod(patch)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.uniform_(self.bias, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[..., c * pt * ph * pw] -> [..., h]."""
        return F.linear(tokens, self.weight.flatten(1), self.bias)


class TextEmbedder(nn.Module):
    """diffusers' `PixArtAlphaTextProjection(text_dim, h, gelu_tanh)`: linear_1 (column-parallel), GELU-tanh,
    linear_2 (row-parallel)."""

    def __init__(self, config: WanConfig, submodules: WanLayerSubmodules, tp_group) -> None:
        super().__init__()
        h = config.hidden_size
        self.linear_1 = build_module(submodules.column, config.text_dim, h, gather_output=False,
                                     **linear_kwargs(config, tp_group, False))
        self.linear_2 = build_module(submodules.row, h, h, input_is_parallel=True,
                                     **linear_kwargs(config, tp_group, False))

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        """[s, b, text_dim] -> [s, b, h]."""
        return self.linear_2(F.gelu(self.linear_1(text)[0], approximate="tanh"))[0]


class WanModel(DiTStage):
    """The stage of a Wan DiT held by this rank. `forward(batch) -> velocity [b, s_local, C]` (packed like the
    latents) on the last stage, the packed `[s_txt + s_local, b, h]` hidden states on the others."""

    def __init__(
        self,
        config: WanConfig,
        layer_spec: WanLayerSubmodules,
        groups,  # megatron_omni.parallel.ParallelGroups (typed loosely: models sit below parallel helpers)
        pre_process: bool | None = None,
        post_process: bool | None = None,
    ) -> None:
        super().__init__(config, groups, pre_process, post_process)
        pg = self.pg_collection
        h, dtype = config.hidden_size, config.params_dtype
        self.time_embedder = TimestepEmbedder(h, config.freq_dim, dtype=dtype, scale=1.0, round_timestep=False)
        # Column-parallel, gathered: [b, 6h] on every tp rank; replicated over stages like the embedder. A
        # Megatron-Core linear under every spec (TE's column-parallel linear cannot gather its output).
        self.time_proj = ColumnParallelLinear(h, 6 * h, gather_output=True, **linear_kwargs(config, pg.tp, False))
        for p in self.time_proj.parameters():
            p.pipeline_parallel = True
        if self.pre_process:
            self.patch_embedding = PatchEmbedding3D(config.in_channels, h, tuple(config.patch_size), dtype)
            self.text_embedder = TextEmbedder(config, layer_spec, pg.tp)
        self.layers = nn.ModuleList(
            WanLayer(config, layer_spec, self.layer_offset + i + 1, pg, self.ulysses_group, self.ring_group)
            for i in range(self.num_stage_layers)
        )
        if self.post_process:
            self.scale_shift_table = nn.Parameter(torch.randn(1, 2, h, dtype=dtype) / h**0.5)
            self.proj_out = nn.Linear(h, config.out_channels * math.prod(config.patch_size), dtype=dtype)

    def timestep_embedding(self, sigma: torch.Tensor, s_vid: int, shard: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The timestep embedding and its projection: sigma [b] -> ([b, h], [b, 6, h]); per-token sigma [b, s_vid]
        (Wan2.2 TI2V's expanded timesteps: the conditioned first frame at 0) -> this CP rank's tokens'
        ([s_local, b, h], [s_local, b, 6, h]). The per-token case embeds each distinct timestep once (a step has
        one or two) and gathers per token, which equals diffusers' embedding of every token."""
        t = sigma.float() * NUM_TRAIN_TIMESTEPS
        dtype = self.config.params_dtype
        if t.ndim == 1:
            temb = self.time_embedder(t, dtype)  # [b, h]
            return temb, self.time_proj(F.silu(temb))[0].unflatten(-1, (6, -1))
        if t.ndim != 2 or t.shape[1] != s_vid:
            raise ValueError(f"per-token sigma {tuple(sigma.shape)} does not match {s_vid} video tokens")
        values, index = torch.unique(t, return_inverse=True)
        temb = self.time_embedder(values, dtype)  # [u, h]
        proj = self.time_proj(F.silu(temb))[0].unflatten(-1, (6, -1))  # [u, 6, h]
        index = index[:, shard].transpose(0, 1)  # [s_local, b]
        return temb[index], proj[index]

    def forward(self, batch: DiTBatch) -> torch.Tensor:
        cfg = self.config
        f, hh, ww = batch.grid
        if max(batch.grid) > cfg.rope_max_seq_len:
            raise ValueError(f"patch grid {tuple(batch.grid)} exceeds rope_max_seq_len={cfg.rope_max_seq_len}")
        s_vid = f * hh * ww
        shard = self.image_shard(s_vid)
        dtype = cfg.params_dtype
        temb, temb_proj = self.timestep_embedding(batch.sigma, s_vid, shard)

        if self.pre_process:
            if batch.latents.shape[1] != s_vid or batch.latents.shape[2] != cfg.patch_channels:
                raise ValueError(f"latents {tuple(batch.latents.shape)} do not match grid {tuple(batch.grid)} with "
                                 f"{cfg.patch_channels} channels per patch")
            vid = self.patch_embedding(batch.latents[:, shard].to(dtype)).transpose(0, 1)
            txt = self.text_embedder(batch.prompt_embeds.to(dtype).transpose(0, 1))
        else:
            txt, vid = self.stage_input(shard.stop - shard.start)

        angles = wan_rope_angles(f, hh, ww, cfg.rope_axes_dims, cfg.rope_theta)
        rope = rope_rotations(angles[shard]).to(vid.device)
        for i, layer in enumerate(self.layers):
            if self.recompute_block(i):
                vid = tensor_parallel.checkpoint(layer, False, vid, txt, temb_proj, rope)
            else:
                vid = layer(vid, txt, temb_proj, rope)

        if not self.post_process:
            return torch.cat([txt, vid], dim=0)
        # [1 | s, b, 2, h] -> shift, scale [1 | s, b, h] (diffusers' order for the output modulation)
        temb = temb if temb.ndim == 3 else temb[None]
        shift, scale = (self.scale_shift_table.float() + temb.float()[:, :, None]).movedim(2, 0).unbind(0)
        normed = F.layer_norm(vid.float(), vid.shape[-1:], eps=cfg.norm_eps)
        out = self.proj_out((normed * (1 + scale) + shift).to(vid.dtype))  # [s, b, (pt ph pw) * c]
        # proj_out's channels run (pt, ph, pw, c); the latents' run (c, pt, ph, pw)
        out = out.unflatten(-1, (math.prod(cfg.patch_size), cfg.out_channels)).transpose(-1, -2).flatten(-2)
        return out.transpose(0, 1)
