"""The clipped FlowGRPO policy loss, its KL term and the training metrics.

Over the trained (window) steps: `ratio = exp(logp_new - logp_old)`,
`L = mean(max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high))) + beta KL`, with
`KL = mean over elements of (mean_theta - mean_ref)^2 / (2 std^2)` (flow_grpo's form; std is the step's
noise coefficient, `SdeCoefficients.std`). Metrics: `approx_kl = 0.5 mean(dlogp^2)`,
`clipfrac = P(|ratio - 1| > eps)` and ratio statistics.

With a behaviour policy other than the old one (a quantized or asynchronous rollout), each term is multiplied
by its truncated importance weight `w = min(pi_old / mu, cap)` (`algorithms.importance`, no gradient):
`L = mean(w max(...)) + beta KL`, the TIS form of the surrogate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLoss:
    """loss: scalar to backpropagate; policy_loss, kl_loss: scalars (kl 0 when beta == 0);
    ratio: same shape as the log-probs; metrics: detached scalars for logging."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    ratio: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _clip_bounds(clip_range: float | tuple[float, float]) -> tuple[float, float]:
    low, high = (clip_range, clip_range) if isinstance(clip_range, int | float) else clip_range
    if low <= 0 or high <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    return float(low), float(high)


def kl_penalty(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample KL between the current and reference transitions (equal std).

    Args:
        mean, ref_mean: [B, ...] transition means of the policy and the reference model.
        std: [B] the step's noise coefficient.

    Returns:
        [B] float32: mean over elements of (mean - ref_mean)^2, divided by 2 std^2.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} vs ref_mean {tuple(ref_mean.shape)}")
    diff = mean.float() - ref_mean.float()
    per_sample = (diff**2).mean(dim=tuple(range(1, diff.ndim)))
    return per_sample / (2 * std.float().reshape(-1) ** 2)


def policy_metrics(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, ratio: torch.Tensor, clip_range: float | tuple
) -> dict[str, torch.Tensor]:
    """approx_kl, clipfrac (|ratio - 1| beyond the clip range) and ratio mean/std/min/max, detached."""
    low, high = _clip_bounds(clip_range)
    dlogp = (log_probs.float() - old_log_probs.float()).detach()
    r = ratio.detach()
    clipped = (r < 1 - low) | (r > 1 + high)
    return {
        "approx_kl": 0.5 * (dlogp**2).mean(),
        "clipfrac": clipped.float().mean(),
        "ratio_mean": r.mean(),
        "ratio_std": r.std(correction=0),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "dlogp_abs_mean": dlogp.abs().mean(),
    }


def flowgrpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float | tuple[float, float],
    beta: float = 0.0,
    kl: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped surrogate over samples x trained steps.

    Args:
        log_probs: [B, S] (or [B]) log-probs under the current parameters (carry the gradient).
        old_log_probs: same shape, from the rollout (no gradient).
        advantages: [B] (broadcast over steps) or the same shape as log_probs.
        clip_range: eps, or (eps_low, eps_high).
        beta: KL weight; when > 0, `kl` ([B] or [B, S] from `kl_penalty`) is required.
        is_weights: optional, the log-probs' shape: truncated importance weights multiplying each clipped term
            (`importance.truncated_importance_weights`; detached here); None: every weight 1.

    Returns:
        PolicyLoss with scalar losses and detached metrics.
    """
    if log_probs.shape != old_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} vs old_log_probs {tuple(old_log_probs.shape)}")
    low, high = _clip_bounds(clip_range)
    lp = log_probs.float()
    adv = advantages.float().detach()
    if adv.shape != lp.shape:
        if adv.ndim != 1 or adv.shape[0] != lp.shape[0]:
            raise ValueError(f"advantages {tuple(adv.shape)} do not match log_probs {tuple(lp.shape)}")
        adv = adv.view(-1, *([1] * (lp.ndim - 1))).expand_as(lp)
    ratio = torch.exp(lp - old_log_probs.float().detach())
    policy_loss = weighted(clipped_terms(ratio, adv, low, high), is_weights).mean()
    return policy_loss_with_kl(policy_loss, beta, kl, ratio, policy_metrics(lp, old_log_probs, ratio, (low, high)))


def clipped_terms(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The clipped surrogate's terms `max(-A ratio, -A clip(ratio, 1 - low, 1 + high))`, elementwise (ratio and
    advantages of one shape, float32)."""
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high))


def weighted(terms: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    """`terms` (float32, any shape) times the importance weights of the same shape (detached, float32); `terms`
    itself when there are none. Raises ValueError on a shape mismatch."""
    if is_weights is None:
        return terms
    if is_weights.shape != terms.shape:
        raise ValueError(f"is_weights {tuple(is_weights.shape)} vs the loss terms {tuple(terms.shape)}")
    return terms * is_weights.detach().float()


def policy_loss_with_kl(policy_loss: torch.Tensor, beta: float, kl: torch.Tensor | None, ratio: torch.Tensor,
                        metrics: dict[str, torch.Tensor]) -> PolicyLoss:
    """`policy_loss + beta mean(kl)` as a PolicyLoss (kl [B] or [B, S] required when beta > 0; the kl term 0
    otherwise), `metrics` completed with policy_loss and kl_loss."""
    if beta > 0:
        if kl is None:
            raise ValueError("beta > 0 needs the per-sample kl term")
        kl_loss = kl.float().mean()
    else:
        kl_loss = torch.zeros((), dtype=torch.float32, device=policy_loss.device)
    metrics.update(policy_loss=policy_loss.detach(), kl_loss=kl_loss.detach())
    return PolicyLoss(loss=policy_loss + beta * kl_loss, policy_loss=policy_loss, kl_loss=kl_loss, ratio=ratio,
                      metrics=metrics)
