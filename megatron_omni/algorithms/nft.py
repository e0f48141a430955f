"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): online RL on the forward (noising) process.

No log-probs and no trajectories: the rollout may use any sampler (the ODE); training needs only each sample's
clean latents x0 and its reward. Each (sample, training step) pair draws a noise level t from the rollout's
grid and fresh noise eps, noises `x_t = (1 - t) x0 + t eps`, and compares the current velocity `v` with the
old (sampling) policy's `v_old` at that point. The positive and the implicit negative policy

    v+ = beta v + (1 - beta) v_old          v- = (1 + beta) v_old - beta v

are each scored by the x0-prediction error `||x_t - t v* - x0||^2` divided by its own detached mean absolute
error (adaptive weighting), and mixed by the reward's optimality probability `r` in [0, 1]:

    r = clip(clip(A, -c, c) / c / 2 + 1/2, 0, 1)                                 (c = adv_clip)
    L = c * mean_i( r_i L+_i / beta + (1 - r_i) L-_i / beta )  (+ kl_beta mean((v - v_ref)^2))

Positive samples (r > 1/2) pull v toward reproducing themselves, negative ones push it away, through one
supervised-looking objective. Conventions, defaults and the old policy's decay schedule follow NVlabs'
reference (`scripts/train_nft_sd3.py`, `config/nft.py`; docs/recipes.md lists the defaults taken). Pure torch
in float32 (the adaptive weights in float64 as the reference computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADV_MODES = ("all", "positive_only", "negative_only", "binary")


@dataclass
class NftLoss:
    """loss: scalar to backpropagate; policy_loss, kl_loss: scalars; metrics: detached scalars."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def optimality_probability(advantages: torch.Tensor, adv_clip: float, mode: str = "all") -> torch.Tensor:
    """The reward weight r in [0, 1] of each sample from its advantage.

    Args:
        advantages: [N] group-relative advantages.
        adv_clip: c > 0: advantages are clipped to [-c, c], then mapped linearly onto [0, 1].
        mode: "all" (both signs), "positive_only" / "negative_only" (the other sign clipped to 0, i.e. r = 1/2:
            no pull either way), "binary" (A replaced by sign(A) before the map, as the reference does: r in
            {1/2 - 1/(2c), 1/2, 1/2 + 1/(2c)}).

    Returns:
        [N] float32.
    """
    if adv_clip <= 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
    if mode not in ADV_MODES:
        raise ValueError(f"unknown adv mode {mode!r}; expected one of {ADV_MODES}")
    a = advantages.float().clamp(-adv_clip, adv_clip)
    if mode == "positive_only":
        a = a.clamp(min=0)
    elif mode == "negative_only":
        a = a.clamp(max=0)
    elif mode == "binary":
        a = torch.sign(a)
    return (a / adv_clip / 2 + 0.5).clamp(0, 1)


def noised_latents(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The forward process `x_t = (1 - t) x0 + t eps`: x0, noise [B, ...], sigma [B] -> [B, ...] float32."""
    if x0.shape != noise.shape or sigma.shape != (x0.shape[0],):
        raise ValueError(f"x0 {tuple(x0.shape)}, noise {tuple(noise.shape)} and sigma {tuple(sigma.shape)} must "
                         "be [B, ...], [B, ...] and [B]")
    t = sigma.float().view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0.float() + t * noise.float()


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x0: torch.Tensor,
    xt: torch.Tensor,
    sigma: torch.Tensor,
    reward_weight: torch.Tensor,
    beta: float,
    adv_clip: float,
    weight_min: float = 1e-5,
    kl_beta: float = 0.0,
    ref_velocity: torch.Tensor | None = None,
) -> NftLoss:
    """DiffusionNFT's loss over B (sample, noise level) points.

    Args:
        velocity: [B, ...] the current model's velocity at x_t (carries the gradient).
        old_velocity: [B, ...] the sampling (old) policy's velocity at the same x_t (no grad).
        x0: [B, ...] the clean latents the rollout produced; xt: [B, ...] their noised points; sigma: [B] t.
        reward_weight: [B] r in [0, 1] (`optimality_probability`).
        beta: the mixing strength of the implicit policies (> 0).
        adv_clip: c, the loss's scale (the reference multiplies by it).
        weight_min: floor of the adaptive weights.
        kl_beta: weight of `mean((v - v_ref)^2)`; when > 0, `ref_velocity` [B, ...] is required.

    Returns:
        NftLoss (float32) with metrics: positive_loss, negative_loss, old_deviate (mean (v - v_old)^2),
        reward_weight_mean, policy_loss, kl_loss.
    """
    if beta <= 0 or adv_clip <= 0 or weight_min <= 0:
        raise ValueError(f"beta ({beta}), adv_clip ({adv_clip}) and weight_min ({weight_min}) must be > 0")
    shape = velocity.shape
    b = shape[0]
    for name, t in (("old_velocity", old_velocity), ("x0", x0), ("xt", xt)):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} does not match velocity {tuple(shape)}")
    if sigma.shape != (b,) or reward_weight.shape != (b,):
        raise ValueError(f"sigma {tuple(sigma.shape)} and reward_weight {tuple(reward_weight.shape)} must be [B]")
    dims = tuple(range(1, velocity.ndim))
    v = velocity.float()
    v_old = old_velocity.float().detach()
    x0, xt = x0.float().detach(), xt.float().detach()
    t = sigma.float().view(-1, *([1] * (velocity.ndim - 1)))
    r = reward_weight.float().detach()

    def _weighted_error(v_mix: torch.Tensor) -> torch.Tensor:
        x0_pred = xt - t * v_mix
        with torch.no_grad():
            weight = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=weight_min)
        return ((x0_pred - x0) ** 2 / weight.float()).mean(dim=dims)

    positive = _weighted_error(beta * v + (1 - beta) * v_old)
    negative = _weighted_error((1 + beta) * v_old - beta * v)
    policy_loss = ((r * positive + (1 - r) * negative) / beta * adv_clip).mean()
    if kl_beta > 0:
        if ref_velocity is None or ref_velocity.shape != shape:
            raise ValueError("kl_beta > 0 needs ref_velocity of the velocity's shape")
        kl_loss = ((v - ref_velocity.float().detach()) ** 2).mean(dim=dims).mean()
    else:
        kl_loss = torch.zeros((), dtype=torch.float32, device=v.device)
    metrics = {
        "positive_loss": positive.detach().mean(),
        "negative_loss": negative.detach().mean(),
        "old_deviate": ((v.detach() - v_old) ** 2).mean(),
        "reward_weight_mean": r.mean(),
        "policy_loss": policy_loss.detach(),
        "kl_loss": kl_loss.detach(),
    }
    return NftLoss(loss=policy_loss + kl_beta * kl_loss, policy_loss=policy_loss, kl_loss=kl_loss, metrics=metrics)


def old_policy_decay(update: int, flat: int, rate: float, cap: float) -> float:
    """The old (sampling) policy's decay after `update` optimizer updates: 0 for the first `flat`, then rising
    by `rate` per update up to `cap`. After each RL step the old weights become `decay old + (1 - decay) new`;
    decay 0 makes the sampling policy the current one. The reference's schedules (`return_decay`): type 0 =
    (0, 0, 0), type 1 = (0, 0.001, 0.5), type 2 = (75, 0.0075, 0.999)."""
    if flat < 0 or rate < 0 or not 0 <= cap < 1:
        raise ValueError(f"decay schedule flat={flat}, rate={rate}, cap={cap}: need flat, rate >= 0 and 0 <= cap < 1")
    if update < flat:
        return 0.0
    return min((update - flat) * rate, cap)


def training_sigmas(grid: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """Each sample's `count` training noise levels: a random permutation of its grid's T noise levels (the grid
    without its final 0), the first `count` of them (the reference trains `int(T * timestep_fraction)` of the
    sampling timesteps, shuffled per sample).

    Args:
        grid: [N, T + 1] each sample's sampling grid (decreasing to 0).
        count: 1 <= count <= T.
        generator: the permutations' source (CPU).

    Returns:
        [N, count] float32.
    """
    n, t1 = grid.shape
    if not 1 <= count <= t1 - 1:
        raise ValueError(f"count must be in [1, {t1 - 1}] (the grid's noise levels), got {count}")
    perms = torch.stack([torch.randperm(t1 - 1, generator=generator)[:count] for _ in range(n)])
    return grid[:, :-1].float().gather(1, perms.to(grid.device))
