"""The guided velocity of a batch, shared by rollout and log-prob recompute so both run the same code.

A velocity model is any callable with the keyword interface of diffusers' `QwenImageTransformer2DModel.
forward` (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes,
return_dict=False) returning a tuple whose first item is [B, S, C_out * p^2]: the diffusers transformer
itself, or the trainer's Megatron model behind an adapter. The trainer's pipeline-parallel path cannot call
one model: it feeds `GuidedBatch.model_inputs` to the first stage and `GuidedBatch.combine` to the last
stage's output, the same two halves `GuidedBatch.velocity` joins around one `forward_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_omni.algorithms.cfg import true_cfg
from megatron_omni.algorithms.schedule import model_timesteps

VelocityModel = Callable[..., Any]


def pad_text(embeds: Sequence[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad per-sample text embeddings.

    Args:
        embeds: B tensors [L_i, D].
        length: pad to this length (>= max L_i); default max L_i.

    Returns:
        ([B, L, D] embeddings with zero padding, [B, L] long mask with 1 on real tokens).
    """
    if not embeds:
        raise ValueError("no embeddings to pad")
    max_len = max(e.shape[0] for e in embeds)
    length = max_len if length is None else length
    if length < max_len:
        raise ValueError(f"pad length {length} shorter than the longest text {max_len}")
    width = embeds[0].shape[1]
    out = embeds[0].new_zeros(len(embeds), length, width)
    mask = torch.zeros(len(embeds), length, dtype=torch.long, device=embeds[0].device)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask


@dataclass
class GuidedBatch:
    """The rows one velocity forward runs for a batch of B samples: the B conditional rows, then one
    negative-prompt row per CFG sample (K of them), text padded to a common length L.

    latents [B + K, S, C] fp32; text [B + K, L, D]; mask [B + K, L]; sigma [B + K];
    cfg_rows [K] long (which of the B samples run CFG); guidance_scale [B] or None; img_shape (1, h, w).
    cond_latents [B + K, S_c, C] or None: conditioning-image tokens (Qwen-Image-Edit's sources) that follow the
    latents in the forward's image stream, on patch grids `cond_shapes`; the velocity is read from the first S.
    pooled [B + K, P] pooled text embeddings of a family conditioned on them (SD3.5), or None; cfg_rescale: true
    CFG rescales per token (Qwen-Image) or not (SD3.5, plain guidance). distilled_guidance [B + K]: the guidance
    scale a guidance-distilled model takes as an input (FLUX.1-dev), or None. clean_tokens: the leading latent tokens
    that are a clean image condition (Wan2.2 TI2V's first frame): the forward's timestep is then per token
    `[B + K, S]`, 0 on them.
    """

    latents: torch.Tensor
    text: torch.Tensor
    mask: torch.Tensor
    sigma: torch.Tensor
    cfg_rows: torch.Tensor
    guidance_scale: torch.Tensor | None
    img_shape: tuple[int, int, int]
    cond_latents: torch.Tensor | None = None
    cond_shapes: tuple[tuple[int, int, int], ...] = ()
    pooled: torch.Tensor | None = None
    cfg_rescale: bool = True
    distilled_guidance: torch.Tensor | None = None
    clean_tokens: int = 0

    @property
    def batch(self) -> int:
        """B, the number of samples (the forward runs B + K rows)."""
        return self.latents.shape[0] - self.cfg_rows.numel()

    def model_inputs(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The forward's tensors in the model's compute dtype: hidden_states [B + K, S, C],
        encoder_hidden_states [B + K, L, D], encoder_hidden_states_mask [B + K, L], timestep [B + K] (and
        pooled_projections [B + K, P] when the batch has pooled embeddings); with conditioning tokens
        hidden_states is [B + K, S + S_c, C]; with clean tokens timestep is [B + K, S], 0 on them."""
        latents = self.latents if self.cond_latents is None else torch.cat([self.latents, self.cond_latents], 1)
        sigma = self.sigma
        if self.clean_tokens:
            sigma = sigma[:, None].expand(-1, self.latents.shape[1]).clone()
            sigma[:, : self.clean_tokens] = 0
        out = dict(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=self.text.to(dtype),
            encoder_hidden_states_mask=self.mask,
            timestep=model_timesteps(sigma, dtype),
        )
        if self.pooled is not None:
            out["pooled_projections"] = self.pooled.to(dtype)
        if self.distilled_guidance is not None:
            out["guidance"] = self.distilled_guidance.float()
        return out

    @property
    def img_shapes_row(self) -> list[tuple[int, int, int]]:
        """One row of the forward's `img_shapes`: the latent's grid, then each conditioning image's."""
        return [tuple(self.img_shape), *(tuple(g) for g in self.cond_shapes)]

    @property
    def stream_tokens(self) -> int:
        """Image-stream tokens of one forward row: S, plus S_c with conditioning images."""
        return self.latents.shape[1] + (0 if self.cond_latents is None else self.cond_latents.shape[1])

    def combine(self, v_all: torch.Tensor) -> torch.Tensor:
        """[B + K, S (+ S_c), C] velocities of the forward's rows -> [B, S, C] fp32 guided velocity (true CFG);
        the conditioning tokens' outputs are dropped, as diffusers' edit pipeline drops them."""
        if self.cond_latents is not None and v_all.shape[1] == self.stream_tokens:
            v_all = v_all[:, : self.latents.shape[1]]
        if v_all.shape != self.latents.shape:
            raise ValueError(f"velocity model returned {tuple(v_all.shape)} for latents {tuple(self.latents.shape)}")
        v_all = v_all.float()
        b = self.batch
        if self.cfg_rows.numel() == 0:
            return v_all
        v = v_all[:b].clone()
        v[self.cfg_rows] = true_cfg(v_all[self.cfg_rows], v_all[b:], self.guidance_scale[self.cfg_rows],
                                    rescale=self.cfg_rescale)
        return v

    def velocity(self, model: VelocityModel, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[B, S, C] float32 guided velocity: one forward of `model` (compute dtype `dtype`) over the B + K rows,
        combined with true CFG."""
        return self.combine(forward_rows(model, self, dtype))


def guided_batch(
    latents: torch.Tensor,
    sigma: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor,
    img_shape: tuple[int, int, int],
    guidance_scale: torch.Tensor | None = None,
    negative_embeds: torch.Tensor | None = None,
    negative_mask: torch.Tensor | None = None,
    cond_latents: torch.Tensor | None = None,
    cond_shapes: tuple[tuple[int, int, int], ...] = (),
    pooled: torch.Tensor | None = None,
    negative_pooled: torch.Tensor | None = None,
    cfg_rescale: bool = True,
    distilled_guidance: torch.Tensor | None = None,
    clean_tokens: int = 0,
) -> GuidedBatch:
    """Stack the conditional rows and the negative rows of the CFG samples into one forward's batch; its
    `velocity(model, dtype)` is each row's velocity with true CFG on the rows whose guidance scale is > 1.

    The conditional rows and the negative rows of the CFG samples run in ONE forward (text padded to a
    common length; masked padding does not change the result beyond float rounding).

    Args:
        latents: [B, S, C] packed latents x_t (fp32).
        sigma: [B] each row's current sigma.
        prompt_embeds, prompt_mask: [B, L, D], [B, L].
        img_shape: (1, h, w) patch grid shared by the batch.
        guidance_scale: [B] (None: no CFG anywhere).
        negative_embeds, negative_mask: [B, Ln, D], [B, Ln]; rows without CFG are ignored.
        cond_latents: [B, S_c, C] conditioning-image tokens (an edit's sources) on grids `cond_shapes`, or None.
        pooled, negative_pooled: [B, P] pooled text embeddings of the prompts and negative prompts (a family
            conditioned on them; None otherwise).
        cfg_rescale: true CFG's per-token rescale (False: plain guidance).
        distilled_guidance: [B] a guidance-distilled model's guidance input (FLUX.1-dev), or None.
        clean_tokens: leading tokens of `latents` that are a clean image condition (timestep 0; Wan2.2 TI2V).
    """
    if (cond_latents is None) != (not cond_shapes):
        raise ValueError("cond_latents and cond_shapes go together (conditioning tokens and their grids)")
    cond_shapes = tuple(tuple(g) for g in cond_shapes)
    cfg_rows = (
        torch.nonzero(guidance_scale > 1).flatten() if guidance_scale is not None else torch.zeros(0, dtype=torch.long)
    )
    if cfg_rows.numel() == 0:
        return GuidedBatch(latents, prompt_embeds, prompt_mask, sigma, cfg_rows, guidance_scale, tuple(img_shape),
                           cond_latents, cond_shapes, pooled, cfg_rescale, distilled_guidance, clean_tokens)
    if negative_embeds is None or negative_mask is None:
        raise ValueError("guidance_scale > 1 needs negative prompt embeddings")
    if (pooled is None) != (negative_pooled is None):
        raise ValueError("pooled embeddings need their negative prompt's pooled embeddings for true CFG")
    length = max(prompt_embeds.shape[1], negative_embeds.shape[1])

    def _pad(t: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = length - t.shape[1]
        if extra == 0:
            return t, m
        return (
            torch.cat([t, t.new_zeros(t.shape[0], extra, t.shape[2])], dim=1),
            torch.cat([m, m.new_zeros(m.shape[0], extra)], dim=1),
        )

    pos_t, pos_m = _pad(prompt_embeds, prompt_mask)
    neg_t, neg_m = _pad(negative_embeds[cfg_rows], negative_mask[cfg_rows])
    return GuidedBatch(
        latents=torch.cat([latents, latents[cfg_rows]]),
        text=torch.cat([pos_t, neg_t]),
        mask=torch.cat([pos_m, neg_m]),
        sigma=torch.cat([sigma, sigma[cfg_rows]]),
        cfg_rows=cfg_rows,
        guidance_scale=guidance_scale,
        img_shape=tuple(img_shape),
        cond_latents=None if cond_latents is None else torch.cat([cond_latents, cond_latents[cfg_rows]]),
        cond_shapes=cond_shapes,
        pooled=None if pooled is None else torch.cat([pooled, negative_pooled[cfg_rows]]),
        cfg_rescale=cfg_rescale,
        distilled_guidance=None if distilled_guidance is None else torch.cat([distilled_guidance,
                                                                              distilled_guidance[cfg_rows]]),
        clean_tokens=clean_tokens,
    )


def forward_rows(model: VelocityModel, batch: GuidedBatch, dtype: torch.dtype) -> torch.Tensor:
    """One forward of `model` (diffusers' keyword interface) over the batch's B + K rows -> raw [B + K, S, C]
    velocities (combine them with `batch.combine`)."""
    out = model(**batch.model_inputs(dtype), img_shapes=[batch.img_shapes_row] * batch.latents.shape[0],
                return_dict=False)
    return out[0] if isinstance(out, tuple | list) else out
