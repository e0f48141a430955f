"""The GRPO token loss and the joint AR-DiT objective (pure torch).

Tokens (GRPO / PPO-clip, per token): `ratio_t = exp(logp_t - logp_old_t)`,
`l_t = max(-A ratio_t, -A clip(ratio_t, 1 - eps_low, 1 + eps_high))`, aggregated over valid plan tokens
either as one mean over all tokens of the batch (`token_mean`, DAPO) or as the mean over samples of each
sample's token mean (`seq_mean_token_mean`, the original GRPO).

Joint trajectory (tokens + SDE window steps): the trajectory's log-prob is the sum of the token log-probs
and the window log-probs; each part keeps the clip of its own algorithm (token ratios with eps ~ 0.2, window
ratios with FlowGRPO's eps ~ 1e-4, per-element-mean log-probs), so the objective is the weighted sum of the
two clipped surrogates, `L = w_tok L_tok + w_win L_win`, with the same advantage per trajectory. A weight
of 0 drops a part (freezing a half is done by the caller, on the parameters).
"""

from __future__ import annotations

import torch

from megatron_omni.algorithms.loss import PolicyLoss

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


def _clip_bounds(clip_range: float | tuple[float, float]) -> tuple[float, float]:
    low, high = (clip_range, clip_range) if isinstance(clip_range, int | float) else clip_range
    if low <= 0 or high <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    return float(low), float(high)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is true (raises when none are)."""
    m = mask.to(x.dtype)
    count = m.sum()
    if float(count) == 0:
        raise ValueError("mask selects no positions")
    return (x * m).sum() / count


def grpo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | tuple[float, float] = 0.2,
    aggregation: str = "token_mean",
) -> PolicyLoss:
    """The clipped GRPO surrogate over plan tokens.

    Args:
        log_probs: [B, P] token log-probs under the current parameters (carry the gradient).
        old_log_probs: [B, P] from the rollout / old policy (no gradient).
        advantages: [B], one per sample (broadcast over its tokens).
        mask: [B, P] bool, True on the sample's plan tokens; every sample needs at least one.
        clip_range: eps or (eps_low, eps_high).
        aggregation: "token_mean" or "seq_mean_token_mean".

    Returns:
        PolicyLoss (kl_loss 0) with detached metrics over valid tokens.
    """
    if log_probs.shape != old_log_probs.shape or log_probs.shape != mask.shape or log_probs.ndim != 2:
        raise ValueError(f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and "
                         f"mask {tuple(mask.shape)} must all be [B, P]")
    if advantages.shape != (log_probs.shape[0],):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] = [{log_probs.shape[0]}]")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    mask = mask.bool()
    if not bool(mask.any(dim=1).all()):
        raise ValueError("every sample needs at least one plan token in the mask")
    low, high = _clip_bounds(clip_range)
    lp = log_probs.float()
    # Padded positions may hold anything (e.g. -inf): keep them out of exp().
    dlogp = torch.where(mask, lp - old_log_probs.float().detach(), torch.zeros_like(lp))
    ratio = torch.exp(dlogp)
    adv = advantages.float().detach()[:, None]
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high))
    if aggregation == "token_mean":
        policy_loss = masked_mean(per_token, mask)
    else:
        m = mask.to(per_token.dtype)
        policy_loss = ((per_token * m).sum(1) / m.sum(1)).mean()
    d = dlogp.detach()[mask]
    r = ratio.detach()[mask]
    metrics = {
        "approx_kl": 0.5 * (d**2).mean(),
        "clipfrac": ((r < 1 - low) | (r > 1 + high)).float().mean(),
        "ratio_mean": r.mean(),
        "ratio_max": r.max(),
        "ratio_min": r.min(),
        "policy_loss": policy_loss.detach(),
    }
    zero = torch.zeros((), dtype=torch.float32, device=lp.device)
    return PolicyLoss(loss=policy_loss, policy_loss=policy_loss, kl_loss=zero, ratio=ratio, metrics=metrics)


def joint_loss(
    token: PolicyLoss | None, window: PolicyLoss | None, token_weight: float = 1.0, window_weight: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`token_weight * token.loss + window_weight * window.loss` and the metrics of both parts, prefixed
    `token/` and `window/`. A part may be None only when its weight is 0; weights must be >= 0, not both 0."""
    if token_weight < 0 or window_weight < 0 or token_weight + window_weight == 0:
        raise ValueError(f"part weights must be >= 0 and not both 0, got {token_weight}, {window_weight}")
    total = None
    metrics: dict[str, torch.Tensor] = {}
    for name, part, weight in (("token", token, token_weight), ("window", window, window_weight)):
        if weight == 0:
            continue
        if part is None:
            raise ValueError(f"the {name} part has weight {weight} but no loss")
        total = weight * part.loss if total is None else total + weight * part.loss
        metrics.update({f"{name}/{k}": v.detach() for k, v in part.metrics.items()})
    metrics["loss"] = total.detach()
    return total, metrics
