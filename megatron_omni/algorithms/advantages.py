"""Group-relative advantages (GRPO): each sample's reward against its prompt group's mean.

`A = (R - mean_group(R)) / (std + eps)`, with std the population standard deviation (ddof 0) of the group
or of the whole (gathered) batch (`global`, flow_grpo's default), then clipped to [-clip, clip]. A group
whose rewards are all equal carries no signal; its share is reported as `zero_std_ratio`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_MODES = ("global", "group")


@dataclass
class Advantages:
    """advantages [N] float32; group_mean, group_std [G] float64 (one per group, in sorted id order);
    zero_std_ratio: fraction of groups with identical rewards; group_ids: the sorted unique ids [G]."""

    advantages: torch.Tensor
    group_ids: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    zero_std_ratio: float


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    std_mode: str = "global",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> Advantages:
    """Group-relative advantages.

    Args:
        rewards: [N] rewards of the whole (already gathered) batch; must be finite.
        group_ids: [N] integer id of each sample's prompt group.
        std_mode: "global" (std of all N rewards) or "group" (std within each group).
        eps: added to the std before dividing.
        clip: clip the advantages to [-clip, clip]; None disables.

    Returns:
        Advantages (advantages [N] float32, computed in float64).
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"unknown std_mode {std_mode!r}; expected one of {STD_MODES}")
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be [N]")
    if rewards.numel() == 0:
        raise ValueError("no rewards")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf")
    if group_ids.dtype.is_floating_point:
        raise ValueError("group_ids must be integers")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    r = rewards.to(torch.float64)
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    g = uniq.numel()
    counts = torch.zeros(g, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, inverse, r) / counts
    centred = r - mean[inverse]
    var = torch.zeros(g, dtype=torch.float64).index_add_(0, inverse, centred**2) / counts
    group_std = var.sqrt()
    # "All rewards equal" is judged on the values, not on std == 0, which rounding can miss.
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    gmin = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    zero_std_ratio = float((gmax == gmin).double().mean())
    std = r.std(correction=0) if std_mode == "global" else group_std[inverse]
    adv = centred / (std + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return Advantages(
        advantages=adv.to(torch.float32),
        group_ids=uniq,
        group_mean=mean,
        group_std=group_std,
        zero_std_ratio=zero_std_ratio,
    )


def term_advantages(
    terms: torch.Tensor,
    weights: torch.Tensor,
    group_ids: torch.Tensor,
    std_mode: str = "global",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> Advantages:
    """GDPO-style advantages of a weighted reward: each term normalised on its own, then summed.

    `A_k = group_advantages(R_k)` (unclipped, `std_mode` as for one reward), `S = sum_k w_k A_k`, then
    `A = (S - mean(S)) / (std(S) + eps)` over the whole batch, clipped to [-clip, clip]. A term on a large
    scale (PickScore ~20) then cannot drown one on a small scale (OCR in [0, 1]) through the shared std.

    Args:
        terms: [N, K] rewards per term (finite).
        weights: [K] term weights.
        group_ids: [N] integer prompt-group ids.
    Returns:
        Advantages with `advantages` [N] as above; group_mean / group_std / zero_std_ratio are those of the
        weighted sum `sum_k w_k R_k`.
    """
    if terms.ndim != 2 or weights.shape != (terms.shape[1],):
        raise ValueError(f"terms {tuple(terms.shape)} must be [N, K] and weights {tuple(weights.shape)} [K]")
    w = weights.to(torch.float64)
    parts = [group_advantages(terms[:, k], group_ids, std_mode, eps, clip=None).advantages.to(torch.float64)
             for k in range(terms.shape[1])]
    s = sum(wk * a for wk, a in zip(w, parts))
    adv = (s - s.mean()) / (s.std(correction=0) + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    whole = group_advantages((terms.to(torch.float64) * w).sum(dim=1), group_ids, std_mode, eps, clip)
    return Advantages(advantages=adv.to(torch.float32), group_ids=whole.group_ids, group_mean=whole.group_mean,
                      group_std=whole.group_std, zero_std_ratio=whole.zero_std_ratio)
