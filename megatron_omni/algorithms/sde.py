"""One stochastic sampling step of a rectified flow and its Gaussian log-probability (FlowGRPO).

Conventions (docs/design.md section 3): `x_s = (1 - s) x0 + s eps`, sigma s in [0, 1] with 1 = noise, the
network predicts the velocity `v ~ eps - x0`, `dt = s_next - s < 0`. All math runs in float32 whatever
the input dtype (bf16 velocities overflow in the mean otherwise), in the same order of operations as the
reference implementations so that rollout and trainer agree bit for bit on the same inputs.

Step types (`noise_level` = a, per sample; a = 0 gives the plain Euler ODE step for every type):

- ``sde`` (flow_grpo): `std = a sqrt(s / (1 - s~))`, s~ = s except s~ = s_1 (the grid's second sigma)
  when s == 1; `mean = x (1 + std^2 dt / (2 s)) + v (1 + std^2 (1 - s) / (2 s)) dt`;
  transition scale `std sqrt(-dt)`; log-prob = per-element MEAN of the Gaussian log density.
- ``cps`` (coefficients-preserving): `std = s_next sin(a pi / 2)`, `mean = (1 - s_next)(x - s v) +
  sqrt(s_next^2 - std^2)(x + (1 - s) v)`, transition scale `std`; log-prob = `-mean((x' - mean)^2)`
  (unnormalised, as the reference codes it: the constants cancel in the ratio).
- ``dance_sde`` (DanceGRPO): `mean = x + v dt - (a^2 / 2) score dt`, `score = -(x - (1 - s) x0^) / s^2`,
  `x0^ = x - s v`; transition scale `a sqrt(-dt)`; log-prob = per-element MEAN Gaussian log density.

The per-element mean (not a sum) is what makes clip ranges of 1e-4..1e-5 meaningful.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SDE_TYPES = ("sde", "cps", "dance_sde")
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class SdeCoefficients:
    """Mean and noise of one transition x_i -> x_{i+1}.

    mean:  [B, ...] float32, the transition mean.
    std:   [B] float32, the noise coefficient the KL term divides by (sde: std_i; cps: the transition
           scale; dance_sde: a).
    scale: [B] float32, the standard deviation of x_{i+1} given x_i (0 for ODE rows).
    """

    mean: torch.Tensor
    std: torch.Tensor
    scale: torch.Tensor


@dataclass
class SdeStepOutput:
    """next_latents [B, ...] fp32; log_prob [B] fp32 (None when not requested); plus the coefficients."""

    next_latents: torch.Tensor
    log_prob: torch.Tensor | None
    coeffs: SdeCoefficients


def _per_sample(value: float | torch.Tensor, batch: int, device: torch.device, name: str) -> torch.Tensor:
    """A scalar or [B] value as a float32 [B] tensor."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        return t.expand(batch).clone()
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"{name} has {t.numel()} values for a batch of {batch}")
    return t


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] matching `like`'s rank."""
    return t.view(-1, *([1] * (like.ndim - 1)))


def sde_coefficients(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float | torch.Tensor,
    sde_type: str = "sde",
    sigma_after_one: float | torch.Tensor | None = None,
) -> SdeCoefficients:
    """Transition mean and noise for each sample of a batch.

    Args:
        latents: x_i, [B, ...] (any float dtype; upcast to fp32).
        velocity: v, [B, ...] same shape (after CFG).
        sigma, sigma_next: s_i and s_{i+1}, scalars or [B] (samples may sit at different steps).
        noise_level: a, scalar or [B]; rows with a = 0 take the Euler ODE step (scale 0).
        sde_type: one of SDE_TYPES.
        sigma_after_one: s_1 of each sample's grid, scalar or [B]; needed by ``sde`` when s_i == 1.

    Returns:
        SdeCoefficients with mean [B, ...] and std, scale [B], all float32.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")
    if latents.shape != velocity.shape:
        raise ValueError(
            f"latents {tuple(latents.shape)} and velocity {tuple(velocity.shape)} differ in shape"
        )
    x = latents.float()
    v = velocity.float()
    b, dev = x.shape[0], x.device
    s = _per_sample(sigma, b, dev, "sigma")
    s_next = _per_sample(sigma_next, b, dev, "sigma_next")
    a = _per_sample(noise_level, b, dev, "noise_level")
    if bool((a < 0).any()):
        raise ValueError("noise_level must be >= 0")
    if bool((s_next >= s).any()):
        raise ValueError("sigma_next must be smaller than sigma (sampling runs from noise to data)")
    dt = s_next - s
    sb, sb_next, dtb = _bcast(s, x), _bcast(s_next, x), _bcast(dt, x)

    if sde_type == "sde":
        at_one = s == 1
        if bool(at_one.any()):
            if sigma_after_one is None:
                raise ValueError("sde step at sigma == 1 needs sigma_after_one (the grid's s_1)")
            s1 = _per_sample(sigma_after_one, b, dev, "sigma_after_one")
            s_tilde = torch.where(at_one, s1, s)
        else:
            s_tilde = s
        std = torch.sqrt(s / (1 - s_tilde)) * a
        stdb = _bcast(std, x)
        mean = x * (1 + stdb**2 / (2 * sb) * dtb) + v * (1 + stdb**2 * (1 - sb) / (2 * sb)) * dtb
        scale = std * torch.sqrt(-dt)
    elif sde_type == "cps":
        std = s_next * torch.sin(a * math.pi / 2)
        stdb = _bcast(std, x)
        x0_hat = x - sb * v
        x1_hat = x + v * (1 - sb)
        mean = x0_hat * (1 - sb_next) + x1_hat * torch.sqrt(sb_next**2 - stdb**2)
        scale = std
    else:  # dance_sde
        mean = x + dtb * v
        x0_hat = x - sb * v
        score = -(x - x0_hat * (1 - sb)) / sb**2
        mean = mean + (-0.5 * _bcast(a, x) ** 2 * score) * dtb
        std = a
        scale = a * torch.sqrt(-dt)
    return SdeCoefficients(mean=mean, std=std, scale=scale)


def sde_log_prob(next_latents: torch.Tensor, coeffs: SdeCoefficients, sde_type: str = "sde") -> torch.Tensor:
    """Log-probability of x_{i+1} under the transition, averaged over all non-batch elements.

    Args:
        next_latents: x_{i+1}, [B, ...].
        coeffs: from `sde_coefficients` on the same batch; every row must be stochastic (scale > 0).
        sde_type: the type the coefficients were computed with.

    Returns:
        [B] float32.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")
    if next_latents.shape != coeffs.mean.shape:
        raise ValueError(f"next_latents {tuple(next_latents.shape)} vs mean {tuple(coeffs.mean.shape)}")
    if not bool((coeffs.scale > 0).all()):
        raise ValueError("log-prob of a deterministic (noise_level 0 / ODE) step is undefined")
    diff = next_latents.detach().float() - coeffs.mean
    dims = tuple(range(1, diff.ndim))
    if sde_type == "cps":
        return -(diff**2).mean(dim=dims)
    scale = _bcast(coeffs.scale, diff)
    log_prob = -(diff**2) / (2 * scale**2) - torch.log(scale) - _LOG_SQRT_2PI
    return log_prob.mean(dim=dims)


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float | torch.Tensor,
    sde_type: str = "sde",
    sigma_after_one: float | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    next_latents: torch.Tensor | None = None,
    compute_log_prob: bool = True,
) -> SdeStepOutput:
    """One sampling step, or the log-prob of a recorded one.

    Sampling: pass `noise` (xi ~ N(0, I), [B, ...]; drawn by the caller from per-sample generators so the
    result does not depend on batch composition): x_{i+1} = mean + scale * xi. Recompute: pass the
    recorded `next_latents` instead. ODE rows (noise_level 0) give x_{i+1} = mean = x + v dt.

    Returns:
        SdeStepOutput; log_prob [B] only when compute_log_prob (then every row must be stochastic).
    """
    coeffs = sde_coefficients(latents, velocity, sigma, sigma_next, noise_level, sde_type, sigma_after_one)
    if next_latents is None:
        if noise is None:
            if bool((coeffs.scale > 0).any()):
                raise ValueError("a stochastic step needs `noise` (or the recorded `next_latents`)")
            next_latents = coeffs.mean
        else:
            if noise.shape != coeffs.mean.shape:
                raise ValueError(f"noise {tuple(noise.shape)} vs latents {tuple(coeffs.mean.shape)}")
            next_latents = coeffs.mean + _bcast(coeffs.scale, coeffs.mean) * noise.float()
    else:
        next_latents = next_latents.float()
    log_prob = sde_log_prob(next_latents, coeffs, sde_type) if compute_log_prob else None
    return SdeStepOutput(next_latents=next_latents, log_prob=log_prob, coeffs=coeffs)


def windowed_sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_after_one: torch.Tensor,
    levels: torch.Tensor,
    sde_type: str,
    generators: Sequence[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sampling step of a batch whose rows are inside or outside their SDE window: rows with
    `levels > 0` draw their noise (latents.shape[1:]) from their own CPU generator, in row order, so a sample
    does not depend on its batch; the others take the ODE step.

    Args:
        latents, velocity: [B, S, C]; sigma, sigma_next, sigma_after_one, levels: [B] (noise level 0 = ODE).
        generators: B CPU generators (only the stochastic rows' are drawn from).

    Returns:
        (next latents [B, S, C] fp32, the stochastic rows [R] (long, on latents' device), their log-probs [R]).
    """
    rows = torch.nonzero(levels > 0).flatten()
    noise = torch.zeros(latents.shape, dtype=torch.float32)
    for r in rows.tolist():
        noise[r] = torch.randn(latents.shape[1:], generator=generators[r])
    out = sde_step(latents, velocity, sigma, sigma_next, levels, sde_type, sigma_after_one=sigma_after_one,
                   noise=noise.to(latents.device), compute_log_prob=False)
    if not rows.numel():
        return out.next_latents, rows, torch.zeros(0, device=latents.device)
    c = out.coeffs
    lp = sde_log_prob(out.next_latents[rows], SdeCoefficients(c.mean[rows], c.std[rows], c.scale[rows]), sde_type)
    return out.next_latents, rows, lp
