"""The loss side of a recorded transition: a trajectory's log-probs under any velocity model (the trainer's
loss, and its side of the consistency check), with the same guided-velocity code and the same SDE step as
the rollout, on the stored latents.

A transition splits in two halves around the velocity forward: `transition_inputs` (sigmas, the guided
batch) and `transition_output` (true CFG, SDE step, log-prob). `transition_step` joins them around one
model call; the trainer's pipeline schedule feeds the first half to its first stage and the second to its
last stage's output, so both paths run the same math."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_omni.algorithms.sde import SdeStepOutput, sde_step
from megatron_omni.algorithms.velocity import GuidedBatch, VelocityModel, forward_rows, guided_batch


class Trajectory(Protocol):
    """What the transition math reads of a rollout record (`rollout.base.Trajectory` is one): N samples,
    W window steps, S image tokens, C packed channels, L text tokens, T + 1 grid points."""

    latents: torch.Tensor  # [N, W, S, C] x_t of each window step
    next_latents: torch.Tensor  # [N, W, S, C] the recorded x_{t+1}
    log_probs: torch.Tensor  # [N, W]
    sigmas: torch.Tensor  # [N, T + 1] each sample's grid
    prompt_embeds: torch.Tensor  # [N, L, D]
    prompt_embeds_mask: torch.Tensor  # [N, L]
    negative_prompt_embeds: torch.Tensor | None
    negative_prompt_embeds_mask: torch.Tensor | None
    guidance_scale: torch.Tensor  # [N]
    img_shape: tuple[int, int, int]
    noise_level: float
    sde_type: str
    # pooled_embeds / negative_pooled_embeds [N, P] and cfg_rescale are read when present (SD3.5's rollouts), and
    # distilled_guidance [N] (FLUX.1-dev's)

    @property
    def step_indices(self) -> torch.Tensor: ...  # [N, W] grid index of each window step


@dataclass
class Recomputed:
    """log_probs [N, W] fp32; means [N, W, S, C] (when requested) and std [N, W] for the KL term."""

    log_probs: torch.Tensor
    std: torch.Tensor
    means: torch.Tensor | None


@dataclass
class TransitionInputs:
    """What the SDE transition of window step j needs for samples `rows` [B], besides the velocity.

    batch: the velocity forward's rows (CFG rows stacked after the B conditional ones); latents,
    next_latents [B, S, C] fp32 (x_t and the recorded x_{t+1}); sigma, sigma_next, sigma_after_one [B].
    """

    batch: GuidedBatch
    latents: torch.Tensor
    next_latents: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    sigma_after_one: torch.Tensor


def conditioning(traj: Trajectory, rows: torch.Tensor) -> dict:
    """`guided_batch`'s conditioning keywords for samples `rows` of `traj`: its source-image tokens and grids
    (an edit trajectory's `cond_latents`, `cond_shapes`), the distilled guidance input of a guidance-distilled
    model's trajectory (`distilled_guidance`), an image-to-video trajectory's clean condition tokens
    (`clean_tokens`), and the pooled text embeddings and CFG kind of a family conditioned on them (SD3.5's and
    FLUX.1's `pooled_embeds` / `negative_pooled_embeds`, `cfg_rescale`); none for a trajectory without them.
    Every forward built from a trajectory (the SDE transitions, DiffusionNFT's noised points) takes these."""
    out = {}
    pooled = getattr(traj, "pooled_embeds", None)
    if pooled is not None:
        out["pooled"] = pooled[rows]
        out["negative_pooled"] = _rows(getattr(traj, "negative_pooled_embeds", None), rows)
    if hasattr(traj, "cfg_rescale"):
        out["cfg_rescale"] = traj.cfg_rescale
    if getattr(traj, "clean_tokens", 0):
        out["clean_tokens"] = int(traj.clean_tokens)
    guidance = getattr(traj, "distilled_guidance", None)
    if guidance is not None:
        out["distilled_guidance"] = guidance[rows]
    cond = getattr(traj, "cond_latents", None)
    if cond is None:
        return out
    return out | {"cond_latents": cond[rows], "cond_shapes": tuple(traj.cond_shapes)}


def _rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t[rows]


def transition_inputs(traj: Trajectory, rows: torch.Tensor, j: int | torch.Tensor) -> TransitionInputs:
    """Gather window step `j` (one for all, or [B] long: one per row) of samples `rows` [B] from `traj`:
    sigmas from each sample's own grid and the guided forward's batch (conditional + negative rows, text
    padded to one length)."""
    idx = traj.step_indices.to(traj.latents.device)[rows, j]
    sig = traj.sigmas[rows]
    sigma = sig.gather(1, idx[:, None]).squeeze(1)
    neg = traj.negative_prompt_embeds
    latents = traj.latents[rows, j]
    batch = guided_batch(
        latents,
        sigma,
        traj.prompt_embeds[rows],
        traj.prompt_embeds_mask[rows],
        traj.img_shape,
        guidance_scale=traj.guidance_scale[rows],
        negative_embeds=None if neg is None else neg[rows],
        negative_mask=None if neg is None else traj.negative_prompt_embeds_mask[rows],
        **conditioning(traj, rows),
    )
    return TransitionInputs(
        batch=batch,
        latents=latents,
        next_latents=traj.next_latents[rows, j],
        sigma=sigma,
        sigma_next=sig.gather(1, (idx + 1)[:, None]).squeeze(1),
        sigma_after_one=sig[:, 1],
    )


def transition_output(traj: Trajectory, inputs: TransitionInputs, v_all: torch.Tensor) -> SdeStepOutput:
    """The transition from the forward's raw velocities `v_all` [B + K, S, C] (CFG combined here):
    log_prob [B] of the recorded next latents, mean [B, S, C] and std [B]. Clean condition tokens
    (`batch.clean_tokens`, image-to-video) are no part of the transition: the log-prob is the generated tokens'
    and their mean is the condition itself."""
    k = inputs.batch.clean_tokens
    out = sde_step(
        inputs.latents[:, k:],
        inputs.batch.combine(v_all)[:, k:],
        inputs.sigma,
        inputs.sigma_next,
        traj.noise_level,
        traj.sde_type,
        sigma_after_one=inputs.sigma_after_one,
        next_latents=inputs.next_latents[:, k:],
    )
    if k:
        out.next_latents = torch.cat([inputs.next_latents[:, :k].float(), out.next_latents], 1)
        out.coeffs.mean = torch.cat([inputs.latents[:, :k].float(), out.coeffs.mean], 1)
    return out


def transition_step(
    traj: Trajectory, model: VelocityModel, rows: torch.Tensor, j: int | torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> SdeStepOutput:
    """The SDE transition of window step `j` (int, or [B] long) for samples `rows` [B] under `model`,
    evaluated at the stored next latents (log_prob [B], mean and std); differentiable when called with grad
    enabled."""
    inputs = transition_inputs(traj, rows, j)
    return transition_output(traj, inputs, forward_rows(model, inputs.batch, dtype))


def recompute_log_probs(
    traj: Trajectory,
    model: VelocityModel,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    return_means: bool = False,
) -> Recomputed:
    """Log-probs of every recorded transition of `traj` under `model`.

    Args:
        traj: a rollout record with W >= 1 window steps.
        model: velocity model (diffusers' transformer forward interface).
        batch_size: samples per forward (default: all N).
        dtype: the model's compute dtype.
        return_means: also return the transition means (for the KL term).

    Returns:
        Recomputed with log_probs [N, W].
    """
    n, w = traj.log_probs.shape
    if w == 0:
        raise ValueError("trajectory has no window steps (an ODE rollout records no transitions)")
    bs = batch_size or n
    device = traj.latents.device
    log_probs = torch.empty(n, w, dtype=torch.float32, device=device)
    stds = torch.empty(n, w, dtype=torch.float32, device=device)
    means = torch.empty_like(traj.latents) if return_means else None
    for j in range(w):
        for lo in range(0, n, bs):
            rows = torch.arange(lo, min(n, lo + bs), device=device)
            out = transition_step(traj, model, rows, j, dtype=dtype)
            log_probs[rows, j] = out.log_prob
            stds[rows, j] = out.coeffs.std
            if means is not None:
                means[rows, j] = out.coeffs.mean
    return Recomputed(log_probs=log_probs, std=stds, means=means)
