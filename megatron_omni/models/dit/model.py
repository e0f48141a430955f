"""An MMDiT (Qwen-Image architecture) as a Megatron-Core model with TP, CP (Ulysses x ring) and PP.

The model is built for one pipeline stage: the first stage owns the input projections (`img_in`,
`txt_norm`, `txt_in`), the last stage `norm_out` and `proj_out`, and every stage its share of the blocks
and a replica of the timestep embedder (its grads are summed across stages by Megatron-Core's
`finalize_model_grads`, as for Megatron's own DiT). Between stages the schedules pass one tensor,
`[s_txt + s_img_local, b, h]`: the text stream followed by this CP rank's image shard.

Inputs follow diffusers' `QwenImageTransformer2DModel.forward` (batch-first at the boundary):
latents `[b, s_img, in_channels]`, prompt embeddings `[b, s_txt, joint_attention_dim]` with a mask, sigma
`[b]` in [0, 1] and the latent grid `(frames, height, width)` in patches. Inside, everything is
sequence-first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from torch import nn

from megatron_omni.models.dit.config import MMDiTConfig
from megatron_omni.models.dit.embeddings import TimestepEmbedder, qwen_stream_rope_angles, rope_rotations
from megatron_omni.models.dit.layer import MMDiTLayer, MMDiTLayerSubmodules
from megatron_omni.models.dit.norms import RMSNorm


@dataclass
class DiTBatch:
    """One micro-batch in diffusers' layout (batch-first); every pipeline stage receives it.

    latents: [b, s_img, in_channels] packed patches (only read on the first stage)
    prompt_embeds: [b, s_txt, joint_attention_dim] (first stage)
    prompt_mask: [b, s_txt] bool, True = valid token, or None
    sigma: [b] noise level in [0, 1] (diffusers' `timestep / 1000`)
    grid: (frames, height, width) of the latent in patches, the same for the whole batch
    cond_grids: the patch grids of conditioning images whose tokens follow the latent's in `latents`
        (Qwen-Image-Edit's source images, diffusers' `img_shapes[i][1:]`); () for plain generation. The image
        stream is then `[generated | cond 1 | ...]`, `s_img` their total, and the output covers all of it.
    pooled: [b, pooled_dim] pooled text embeddings of a family conditioned on them (SD3.5), or None
    guidance: [b] the distilled guidance scale a guidance-distilled model takes as an input (FLUX.1-dev), or None
    """

    latents: torch.Tensor | None
    prompt_embeds: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    sigma: torch.Tensor
    grid: tuple[int, int, int]
    cond_grids: tuple[tuple[int, int, int], ...] = ()
    pooled: torch.Tensor | None = None
    guidance: torch.Tensor | None = None

    @property
    def grids(self) -> tuple[tuple[int, int, int], ...]:
        """Every grid of the image stream, in stream order: the generated latent's, then the conditions'."""
        return (tuple(self.grid), *(tuple(g) for g in self.cond_grids))


class DiTStage(MegatronModule):
    """What every DiT stage of ours shares: its process groups, which blocks and ends of the model it holds,
    the tensor the pipeline schedules hand it, the image (video) tokens of its CP rank, and which of its blocks
    full recompute checkpoints. Between stages travels `[s_txt + s_img_local, b, h]`: the text stream, then
    this CP rank's image shard."""

    def __init__(self, config, groups, pre_process: bool | None = None, post_process: bool | None = None,
                 num_blocks: int | None = None):
        """`num_blocks`: the blocks split over the pipeline stages (default `config.num_layers`; FLUX counts its
        single-stream blocks too)."""
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        pg = groups.mcore
        self.pg_collection = pg
        self.ulysses_group = groups.ulysses if groups.ulysses.size() > 1 else None
        self.ring_group = groups.ring if groups.ring.size() > 1 else None
        self.cp_group = pg.cp
        pp_size, pp_rank = pg.pp.size(), pg.pp.rank()
        self.pre_process = pp_rank == 0 if pre_process is None else pre_process
        self.post_process = pp_rank == pp_size - 1 if post_process is None else post_process
        blocks = config.num_layers if num_blocks is None else num_blocks
        if blocks % pp_size:
            raise ValueError(f"{blocks} blocks are not divisible by {pp_size} pipeline stages")
        self.num_stage_layers = blocks // pp_size
        self.layer_offset = pp_rank * self.num_stage_layers
        self.input_tensor: torch.Tensor | None = None

    def global_name(self, local: str) -> str:
        """The model-wide name of one of this stage's parameter or module names (its block i is block
        `layer_offset + i` of the whole model)."""
        if local.startswith("layers."):
            idx, _, rest = local[len("layers."):].partition(".")
            return f"layers.{int(idx) + self.layer_offset}" + (f".{rest}" if rest else "")
        return local

    # The pipeline schedules hand the previous stage's output here.
    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def image_shard(self, s_img: int) -> slice:
        """The image tokens this CP rank holds: contiguous shard `cp_rank` of `s_img`."""
        cp = self.cp_group.size()
        if s_img % cp:
            raise ValueError(f"{s_img} image tokens are not divisible by context-parallel size {cp}")
        n = s_img // cp
        r = self.cp_group.rank()
        return slice(r * n, (r + 1) * n)

    def stage_input(self, s_img_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(text [s_txt, b, h], image shard [s_img_local, b, h]) from the tensor the schedule handed over."""
        if self.input_tensor is None:
            raise RuntimeError("a non-first pipeline stage needs set_input_tensor() before forward")
        s_txt = self.input_tensor.shape[0] - s_img_local
        return self.input_tensor[:s_txt], self.input_tensor[s_txt:]

    def recompute_block(self, i: int) -> bool:
        """Whether full recompute checkpoints this stage's block i (the first `recompute_num_layers`)."""
        cfg = self.config
        if cfg.recompute_granularity != "full" or not (self.training and torch.is_grad_enabled()):
            return False
        return i < (self.num_stage_layers if cfg.recompute_num_layers is None else cfg.recompute_num_layers)


class MMDiTModel(DiTStage):
    """The stage of an MMDiT held by this rank. `forward(batch) -> velocity [b, s_img_local, out]` on the
    last stage, the packed `[s_txt + s_img_local, b, h]` hidden states on the others."""

    def __init__(
        self,
        config: MMDiTConfig,
        layer_spec: MMDiTLayerSubmodules,
        groups,  # megatron_omni.parallel.ParallelGroups (typed loosely: models sit below parallel helpers)
        pre_process: bool | None = None,
        post_process: bool | None = None,
    ):
        super().__init__(config, groups, pre_process, post_process)
        pg = self.pg_collection
        h = config.hidden_size

        # The plain torch layers are built in the parameters' dtype, as Megatron-Core's linears are: the
        # whole model computes in params_dtype (bf16 mixed precision keeps fp32 copies in the optimizer).
        dtype = config.params_dtype
        self.time_embedder = TimestepEmbedder(h, config.timestep_channels, dtype=dtype)
        if self.pre_process:
            self.img_in = nn.Linear(config.in_channels, h, dtype=dtype)
            self.txt_norm = RMSNorm(config.joint_attention_dim, eps=config.norm_eps, dtype=dtype)
            self.txt_in = nn.Linear(config.joint_attention_dim, h, dtype=dtype)
        self.layers = nn.ModuleList(
            MMDiTLayer(config, layer_spec, self.layer_offset + i + 1, pg, self.ulysses_group, self.ring_group)
            for i in range(self.num_stage_layers)
        )
        if self.post_process:
            self.norm_out = _AdaNormOut(h, config.norm_eps, dtype=dtype)
            self.proj_out = nn.Linear(h, config.patch_size**2 * config.out_channels, dtype=dtype)

    def forward(self, batch: DiTBatch) -> torch.Tensor:
        # Under CP the whole stream (generated tokens, then any conditioning image's) splits contiguously.
        grids = batch.grids
        s_img = sum(f * hh * ww for f, hh, ww in grids)
        shard = self.image_shard(s_img)
        dtype = self.config.params_dtype
        temb = self.time_embedder(batch.sigma, dtype)

        if self.pre_process:
            if batch.latents.shape[1] != s_img:
                raise ValueError(
                    f"latents carry {batch.latents.shape[1]} tokens but grids {grids} have {s_img}"
                )
            img = self.img_in(batch.latents[:, shard].to(dtype)).transpose(0, 1)
            txt = self.txt_in(self.txt_norm(batch.prompt_embeds.to(dtype))).transpose(0, 1)
            s_txt = txt.shape[0]
        else:
            txt, img = self.stage_input(shard.stop - shard.start)
            s_txt = txt.shape[0]

        img_angles, txt_angles = qwen_stream_rope_angles(
            grids, s_txt, tuple(self.config.axes_dims_rope), self.config.rope_theta
        )
        img_rope = rope_rotations(img_angles[shard].to(img.device))
        txt_rope = rope_rotations(txt_angles.to(img.device))
        mask = batch.prompt_mask
        if mask is not None:
            mask = mask.to(device=img.device, dtype=torch.bool)

        cond_temb = cond_tokens = None
        if self.config.zero_cond_t and batch.cond_grids:
            # diffusers' `modulate_index`: 0 on the generated tokens, 1 on the conditioning ones (this CP shard's).
            cond_temb = self.time_embedder(torch.zeros_like(batch.sigma), dtype)
            s_gen = grids[0][0] * grids[0][1] * grids[0][2]
            cond_tokens = (torch.arange(s_img, device=img.device) >= s_gen)[shard]
        img, txt = self._run_layers(img, txt, temb, img_rope, txt_rope, mask, cond_temb, cond_tokens)

        if not self.post_process:
            return torch.cat([txt, img], dim=0)
        out = self.proj_out(self.norm_out(img, temb))
        return out.transpose(0, 1)  # [b, s_img_local, p*p*out]

    def _run_layers(self, img, txt, temb, img_rope, txt_rope, mask, cond_temb=None, cond_tokens=None):
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # The last stage reads only the image stream of its last block.
            run = functools.partial(layer, text_output=not (self.post_process and i == last))
            # The zero_cond_t tensors go positionally (a checkpoint saves its positional inputs) and only when set.
            cond = () if cond_temb is None else (cond_temb, cond_tokens)
            if self.recompute_block(i):
                img, txt = tensor_parallel.checkpoint(run, False, img, txt, temb, img_rope, txt_rope, mask, *cond)
            else:
                img, txt = run(img, txt, temb, img_rope, txt_rope, mask, *cond)
        return img, txt


class _AdaNormOut(nn.Module):
    """Final adaptive LayerNorm: `linear(silu(temb))` chunks as (scale, shift), in that order."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(hidden, 2 * hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(nn.functional.silu(temb)).chunk(2, dim=-1)
        return nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps) * (1 + scale[None]) + shift[None]


def pipeline_seq_length(s_txt: int, s_img: int, cp_size: int) -> int:
    """The `seq_length` to give Megatron-Core's schedules so their per-rank tensor is [s_txt + s_img/cp]."""
    return (s_txt + s_img // cp_size) * cp_size
