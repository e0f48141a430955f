"""Truncated importance weights: the correction for samples drawn by a behaviour policy other than the one the
loss's old log-probs come from.

A quantized rollout engine (FP8 weights) and an asynchronous rollout (weights one or more updates old) both
sample from a behaviour policy mu that differs from the trainer's pi_old. The clipped surrogate is an
expectation under pi_old, so each transition is weighted by `w = pi_old / mu = exp(logp_old - logp_mu)`,
truncated at `cap` to bound the variance (truncated importance sampling, Ionides 2008; the TIS correction of
Yao et al. 2025, verl's `tis_imp_ratio_cap`): `w = min(exp(logp_old - logp_behaviour), cap)`, no gradient.

Levels: `token` (one weight per transition or token), `sample` (one per sample: the product of its
transitions' ratios, exp of the summed log-ratio), `geometric` (one per sample: exp of the mean log-ratio, the
geometric mean, which does not explode with the number of transitions). A sample-level weight is broadcast back
over the sample's transitions.

Metrics (detached scalars): `is_truncated_frac` (the share of weights the cap truncated), `is_weight_mean`,
`is_weight_max` (after truncation, over the kept entries), `dlogp_abs_mean_before` (mean |logp_old -
logp_behaviour| per transition: the gap) and `dlogp_abs_mean_after` (the gap the weights leave uncorrected,
per transition: mean over the weighted units of |unit log-ratio - log w|, a `sample` unit's divided by its
transitions; zero where no weight was truncated). The shares count units (transitions, or samples). Pure
torch, float32 math whatever the inputs' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IS_LEVELS = ("token", "sample", "geometric")


@dataclass
class ImportanceWeights:
    """weights: the truncated weights, the log-probs' shape [N, ...] fp32, detached (a sample-level weight
    repeated over its transitions); log_ratio: logp_old - logp_behaviour per transition (fp32); metrics:
    detached fp32 scalars (see the module docstring)."""

    weights: torch.Tensor
    log_ratio: torch.Tensor
    metrics: dict[str, torch.Tensor]


def truncated_importance_weights(
    old_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    cap: float,
    level: str = "token",
    mask: torch.Tensor | None = None,
) -> ImportanceWeights:
    """Truncated importance weights `min(pi_old / mu, cap)` of recorded transitions.

    Args:
        old_log_probs: [N, ...] log-probs under the trainer's old policy (e.g. FlowGRPO's [N, W] window steps).
        behaviour_log_probs: the same shape, recorded by the policy that sampled (the rollout engine).
        cap: the truncation, >= 1 (a cap below 1 would down-weight every on-policy transition).
        level: one of IS_LEVELS; the sample levels reduce over every dimension after the first.
        mask: optional bool, the log-probs' shape: which entries exist (padding tokens are False); the weights
            of masked-out entries are 1 and they do not count in the metrics or a sample's reduction.

    Returns:
        ImportanceWeights with weights [N, ...] fp32.

    Raises ValueError on mismatched shapes, an unknown level, a cap below 1, or a non-finite log-prob
    among the entries the mask keeps.
    """
    if old_log_probs.shape != behaviour_log_probs.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)} vs behaviour_log_probs "
                         f"{tuple(behaviour_log_probs.shape)}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-weight level {level!r}; expected one of {IS_LEVELS}")
    if not cap >= 1.0:
        raise ValueError(f"the importance-weight cap must be >= 1, got {cap}")
    keep = torch.ones_like(old_log_probs, dtype=torch.bool) if mask is None else mask.bool()
    if keep.shape != old_log_probs.shape:
        raise ValueError(f"mask {tuple(keep.shape)} vs log-probs {tuple(old_log_probs.shape)}")
    log_ratio = (old_log_probs.detach().float() - behaviour_log_probs.detach().float()).masked_fill(~keep, 0.0)
    if not bool(torch.isfinite(log_ratio).all()):
        raise ValueError("non-finite log-probs: the importance weights of a NaN or infinite log-ratio are undefined")
    log_cap = torch.tensor(cap, dtype=torch.float32).log()
    n = keep.sum().clamp(min=1)
    if level == "token":
        unit_log_ratio, unit_keep, per_unit = log_ratio, keep, torch.ones_like(log_ratio)
    else:  # one unit per sample: its summed (sample) or mean (geometric) log-ratio
        dims = tuple(range(1, log_ratio.ndim))
        count = keep.sum(dim=dims).float() if dims else keep.float()
        unit_log_ratio = log_ratio.sum(dim=dims) if dims else log_ratio
        if level == "geometric":
            unit_log_ratio = unit_log_ratio / count.clamp(min=1)
        unit_keep = count > 0
        per_unit = count.clamp(min=1) if level == "sample" else torch.ones_like(count)
    unit_log_w = unit_log_ratio.clamp(max=log_cap)
    log_w = unit_log_w if level == "token" else (
        unit_log_w.view((-1,) + (1,) * (log_ratio.ndim - 1)).expand_as(log_ratio))
    weights = log_w.masked_fill(~keep, 0.0).exp()
    w_kept = weights[keep]
    units = unit_keep.sum().clamp(min=1)
    # the log-ratio the weights leave uncorrected, per transition (a sample-level residual over its transitions)
    residual = ((unit_log_ratio - unit_log_w).abs() / per_unit).masked_fill(~unit_keep, 0.0)
    metrics = {
        "is_truncated_frac": ((unit_log_ratio > log_cap) & unit_keep).float().sum() / units,
        "is_weight_mean": w_kept.mean() if w_kept.numel() else torch.ones(()),
        "is_weight_max": w_kept.max() if w_kept.numel() else torch.ones(()),
        "dlogp_abs_mean_before": log_ratio.abs().sum() / n,
        "dlogp_abs_mean_after": residual.sum() / units,
    }
    return ImportanceWeights(weights=weights, log_ratio=log_ratio, metrics=metrics)
