"""GRPO-Guard (Wang et al. 2025, arXiv 2510.22319): FlowGRPO's clipped surrogate with a normalised ratio.

FlowGRPO's per-element-mean log-ratio of an SDE transition with scale `s = std sqrt(-dt)` is
`dlogp = mean((mu - mu_old) eps) / s - mean((mu - mu_old)^2) / (2 s^2)` (eps the recorded noise): its mean is
below 0 and its spread grows as `1 / s`, differently at every step, so the clip range cannot treat the steps
alike and positive-advantage samples rarely reach it. GRPO-Guard's RatioNorm adds the mean-drift term back
and multiplies by `s`, leaving `mean((mu - mu_old) eps)`: zero-mean and of one scale at every step. Its
gradient reweighting divides each step's loss by `|dt|`, equalising the gradient over noise levels:

    bias_i  = mean((mu_i - mu_old_i)^2) / (2 s_i^2)
    ratio_i = exp((logp_i - logp_old_i + bias_i) * s_i)
    L       = mean_i( max(-A_i ratio_i, -A_i clip(ratio_i, 1 - eps_low, 1 + eps_high)) / |dt_i| ) + beta KL

VeRL-Omni's `GRPOGuardLoss` (the reference implementation this follows) takes one `s` and one `dt` per
micro-batch (the batch means: its micro-batches hold one step of one grid); here each row carries its own, which
is the same when they are equal and right when a micro-batch mixes window steps. Defined for the `sde` step
type only (its Gaussian log-prob is what the algebra above inverts). Float32 like `loss.py`.
"""

from __future__ import annotations

import torch

from megatron_omni.algorithms.loss import (
    PolicyLoss,
    _clip_bounds,
    clipped_terms,
    policy_loss_with_kl,
    policy_metrics,
    weighted,
)


def grpo_guard_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    scale: torch.Tensor,
    dt: torch.Tensor,
    clip_range: float | tuple[float, float],
    beta: float = 0.0,
    kl: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """GRPO-Guard's clipped surrogate over B transitions (one row per sample x window step).

    Args:
        log_probs: [B] log-probs of the recorded transitions under the current parameters (with grad).
        old_log_probs: [B] the same under the rollout's parameters (no grad).
        advantages: [B].
        mean: [B, ...] transition means under the current parameters (with grad: the bias term's).
        old_mean: [B, ...] the rollout parameters' means of the same transitions (no grad).
        scale: [B] the transition's standard deviation `std sqrt(-dt)` (`SdeCoefficients.scale`), > 0.
        dt: [B] the step `s_next - s` (< 0); its magnitude reweights the row's loss.
        clip_range: eps, or (eps_low, eps_high), applied to the normalised ratio.
        beta: KL weight; when > 0, `kl` ([B], `loss.kl_penalty`) is required.
        is_weights: optional [B] truncated importance weights multiplying each row's term (no grad); None: 1.

    Returns:
        PolicyLoss (float32) whose `ratio` [B] is the normalised ratio; metrics as `flowgrpo_loss`'s (on the
        normalised ratio; `approx_kl` and `dlogp_abs_mean` on the raw log-ratio) plus `ratio_mean_bias`.
    """
    b = log_probs.shape[0]
    if log_probs.shape != (b,) or old_log_probs.shape != (b,) or advantages.shape != (b,):
        raise ValueError(f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and "
                         f"advantages {tuple(advantages.shape)} must all be [B]")
    if mean.shape != old_mean.shape or mean.shape[0] != b:
        raise ValueError(f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be [B, ...] with "
                         f"B = {b}")
    if scale.shape != (b,) or dt.shape != (b,):
        raise ValueError(f"scale {tuple(scale.shape)} and dt {tuple(dt.shape)} must be [B]")
    if not bool((scale > 0).all()):
        raise ValueError("GRPO-Guard needs stochastic transitions (scale > 0)")
    if not bool((dt < 0).all()):
        raise ValueError("dt must be < 0 (sampling runs from noise to data)")
    low, high = _clip_bounds(clip_range)
    s = scale.float().detach()
    drift = (mean.float() - old_mean.float().detach()) ** 2
    bias = drift.mean(dim=tuple(range(1, drift.ndim))) / (2 * s**2)
    lp = log_probs.float()
    old = old_log_probs.float().detach()
    ratio = torch.exp((lp - old + bias) * s)
    terms = clipped_terms(ratio, advantages.float().detach(), low, high)
    policy_loss = (weighted(terms, is_weights) / dt.float().detach().abs()).mean()
    metrics = policy_metrics(lp, old, ratio, (low, high))
    metrics["ratio_mean_bias"] = bias.detach().mean()
    return policy_loss_with_kl(policy_loss, beta, kl, ratio, metrics)
