"""The proof after every weight sync that the rollout engine samples with the trainer's weights.

The bridge's coverage check proves that every element of every rollout parameter was written once; it cannot
see a loader that reports a tensor loaded but wrote it elsewhere, a parameter the forward does not read (an
unbound copy), or a stale engine that was never asked to load (VeRL-Omni's users lost weeks to both:
verl-omni #552, verl #7495). So the engine also runs a forward on a fixed tiny trajectory (`probe_trajectory`:
one sample, one SDE transition, 2 x 2 image tokens, 3 text tokens) and its transition means must equal the
trainer model's on the same trajectory within a tolerance set by the compute dtype (`check_probe`).

Transition means rather than raw velocities: they are what both sides already compute through the same
guided-velocity and SDE code (the engine with its transformer, the trainer through its pipeline schedule, so
any tp / cp / pp layout works), and they are linear in the velocity.

A quantized engine (`rollout.quantization`) samples with FP8-rounded weights and activations, so its means
differ from the trainer's by the quantization itself (`check_quantized_probe`). Where the engine can also run
its weights unquantized (fake quantization), the check splits in two, each as strict as it can be: the
unquantized means must equal the trainer's within the dtype tolerance (the weights behind the quantizer are
the synced ones), and the quantized ones must differ from them (the quantizer is on) by at most the
quantizer's bound. An engine holding only FP8 weights is held to the sum of both bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.rollout.base import Trajectory

PROBE_GRID = (1, 2, 2)  # (frames, h, w) patches: 4 image tokens
PROBE_TEXT = 3  # text tokens
PROBE_SEED = 20_240_552  # fixed: every rank and every sync probes the same batch
PROBE_DISTILLED_GUIDANCE = 3.5  # the guidance input of a guidance-distilled model's probe (FluxPipeline's default)
# Largest max |engine mean - trainer mean| accepted, by the lower of the two compute dtypes. fp32: both sides
# run the same math with other kernels (measured ~1e-7 on the tiny model); bf16: a few bf16 roundings of
# the velocity times |dt|, far below what a stale tensor of a trained model moves.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class ProbeMismatch(RuntimeError):
    """The engine's probe forward disagrees with the trainer's: it does not hold the synced weights."""


def probe_trajectory(hf_config: Mapping[str, Any], device: torch.device | None = None, *,
                     channels: int | None = None, text_dim: int | None = None,
                     pooled_dim: int | None = None, distilled_guidance: float | None = None) -> Trajectory:
    """The fixed probe batch for a transformer with diffusers config `hf_config`: one sample whose one window
    step goes from sigma 0.8 to 0.5 (latents [1, 1, 4, C], text [1, 3, D], seeded), no CFG. C and D default to
    Qwen-Image's (`in_channels`, `joint_attention_dim`); another family passes its own (`DiTTraits`: a video
    family's packed 3D-patch channels and text width); `pooled_dim`: the width of a pooled text embedding the
    family is conditioned on (SD3.5's; None: none); `distilled_guidance`: the guidance input of a guidance-distilled
    model (FLUX.1-dev's; None: none)."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    s = PROBE_GRID[0] * PROBE_GRID[1] * PROBE_GRID[2]
    c = int(hf_config["in_channels"]) if channels is None else int(channels)
    d = int(hf_config["joint_attention_dim"]) if text_dim is None else int(text_dim)
    latents = torch.randn(1, 1, s, c, generator=g)
    traj = Trajectory(
        prompts=["probe"],
        group_ids=torch.zeros(1, dtype=torch.long),
        seeds=torch.tensor([PROBE_SEED]),
        prompt_embeds=torch.randn(1, PROBE_TEXT, d, generator=g),
        prompt_embeds_mask=torch.ones(1, PROBE_TEXT, dtype=torch.long),
        negative_prompt_embeds=None,
        negative_prompt_embeds_mask=None,
        guidance_scale=torch.ones(1),
        latents=latents,
        next_latents=latents + 0.1 * torch.randn(latents.shape, generator=g),
        log_probs=torch.zeros(1, 1),
        sigmas=torch.tensor([[0.8, 0.5, 0.0]]),
        window_start=torch.zeros(1, dtype=torch.long),
        images=torch.zeros(1, 3, 16 * PROBE_GRID[1], 16 * PROBE_GRID[2]),
        img_shape=PROBE_GRID,
        noise_level=1.0,
        sde_type="sde",
        pooled_embeds=None if pooled_dim is None else torch.randn(1, int(pooled_dim), generator=g),
        distilled_guidance=None if distilled_guidance is None else torch.tensor([float(distilled_guidance)]),
    )
    if device is None:
        return traj
    return Trajectory(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(traj).items()})


def probe_tolerance(*dtypes: torch.dtype) -> float:
    """The tolerance for a probe between sides computing in `dtypes` (the loosest of them); raises on a dtype
    without one."""
    missing = [d for d in dtypes if d not in TOLERANCES]
    if missing:
        raise ValueError(f"no probe tolerance for {missing}; known: {list(TOLERANCES)}")
    return max(TOLERANCES[d] for d in dtypes)


def check_probe(engine_means: torch.Tensor, trainer_means: torch.Tensor, tolerance: float, what: str) -> float:
    """Compare the engine's probe means [N, W, S, C] with the trainer's; returns max |difference| and raises
    `ProbeMismatch` naming it, the tolerance and `what` (e.g. "after the sync of step 3") when it is larger
    or not finite."""
    if engine_means.shape != trainer_means.shape:
        raise ProbeMismatch(f"probe {what}: the engine returned means of shape {tuple(engine_means.shape)}, the "
                            f"trainer {tuple(trainer_means.shape)}")
    diff = float((engine_means.float().cpu() - trainer_means.float().cpu()).abs().max())
    if not diff <= tolerance:
        raise ProbeMismatch(f"probe {what}: the rollout engine's transformer disagrees with the trainer's model on "
                            f"the fixed probe batch (max |difference| {diff:.3g} > tolerance {tolerance:.3g}): it "
                            "does not sample with the synced weights (a tensor skipped, unbound or stale)")
    return diff


@dataclass(frozen=True)
class QuantizedProbe:
    """What `check_quantized_probe` measured (max |difference| of the probe's transition means).

    weights_diff: unquantized engine vs trainer (None: the engine holds only quantized weights);
    quantization_diff: quantized vs unquantized engine (or vs the trainer when there is no unquantized view);
    bound: the largest quantization_diff accepted (relative tolerance x the probe's velocity term);
    velocity_term: max |means - the means a zero velocity gives| of the trainer's probe.
    """

    weights_diff: float | None
    quantization_diff: float
    bound: float
    velocity_term: float


def _zero_velocity(**kw: Any) -> tuple[torch.Tensor]:
    return (torch.zeros_like(kw["hidden_states"]),)


def velocity_term(traj: Trajectory, means: torch.Tensor) -> float:
    """max |means - m0| over the probe, m0 the transition means of `traj` under a zero velocity: the part of the
    means [N, W, S, C] the velocity contributes (the means are affine in the velocity, so a relative error of
    the velocity moves them by that fraction of this)."""
    zero = recompute_log_probs(traj, _zero_velocity, return_means=True).means
    return float((means.float().cpu() - zero.float().cpu()).abs().max())


def check_quantized_probe(engine_means: torch.Tensor, trainer_means: torch.Tensor, traj: Trajectory,
                          tolerance: float, relative: float, what: str,
                          unquantized_means: torch.Tensor | None = None) -> QuantizedProbe:
    """The probe of a quantized engine (means [N, W, S, C] of the probe batch `traj`, as it samples) against the
    trainer's; `tolerance`: the dtypes' (`probe_tolerance`); `relative`: the quantizer's bound relative to the
    velocity (`quantization.probe_relative_tolerance`); `unquantized_means`: the engine's probe with its
    quantizers off, when it has that view. Raises `ProbeMismatch` naming `what` and the figure when
    - the unquantized means differ from the trainer's by more than `tolerance` (the engine's weights are not
      the synced ones), or
    - the quantized and unquantized means are identical (the engine does not quantize), or differ by more than
      `relative` x the velocity term, or
    - without an unquantized view: the quantized means differ from the trainer's by more than both bounds.
    """
    for name, m in (("engine", engine_means), ("unquantized engine", unquantized_means)):
        if m is not None and m.shape != trainer_means.shape:
            raise ProbeMismatch(f"probe {what}: the {name} returned means of shape {tuple(m.shape)}, the trainer "
                                f"{tuple(trainer_means.shape)}")
    scale = velocity_term(traj, trainer_means)
    bound = relative * scale
    q = engine_means.float().cpu()
    if unquantized_means is None:
        diff = float((q - trainer_means.float().cpu()).abs().max())
        if not diff <= tolerance + bound:
            raise ProbeMismatch(f"probe {what}: the quantized rollout engine's transformer disagrees with the "
                                f"trainer's model on the fixed probe batch (max |difference| {diff:.3g} > the dtype "
                                f"tolerance {tolerance:.3g} + the quantizer's bound {bound:.3g}): it does not sample "
                                "with the synced weights, or its quantization is broken")
        return QuantizedProbe(None, diff, bound, scale)
    weights = check_probe(unquantized_means, trainer_means, tolerance, f"{what} (quantizers off)")
    diff = float((q - unquantized_means.float().cpu()).abs().max())
    if diff == 0:
        raise ProbeMismatch(f"probe {what}: the rollout engine's quantized and unquantized forwards are identical: it "
                            "does not quantize (rollout.quantization asks it to)")
    if not diff <= bound:
        raise ProbeMismatch(f"probe {what}: quantization moves the rollout engine's probe by {diff:.3g}, more than the "
                            f"quantizer's bound {bound:.3g} ({relative:.3g} x the velocity term {scale:.3g})")
    return QuantizedProbe(weights, diff, bound, scale)
