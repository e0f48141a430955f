"""Truncated importance weights against float64 references, at every level, with and without a mask."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_omni.algorithms.importance import IS_LEVELS, truncated_importance_weights


def _reference(old, behaviour, cap, level, mask):
    """float64, one unit at a time: (weights, truncated share, mean weight, max weight, gap before, gap after)."""
    old, behaviour, keep = old.double(), behaviour.double(), mask.bool()
    weights = torch.ones_like(old)
    truncated, residuals = [], []
    for i in range(old.shape[0]):
        d = (old[i] - behaviour[i])[keep[i]]
        if level == "token":
            for j, idx in enumerate(keep[i].nonzero().flatten().tolist()):
                weights[i, idx] = min(math.exp(d[j]), cap)
                truncated.append(math.exp(d[j]) > cap)
                residuals.append(abs(float(d[j]) - math.log(weights[i, idx])))
            continue
        if d.numel() == 0:
            continue
        unit = float(d.sum()) if level == "sample" else float(d.mean())
        w = min(math.exp(unit), cap)
        weights[i][keep[i]] = w
        truncated.append(math.exp(unit) > cap)
        residuals.append(abs(unit - math.log(w)) / (d.numel() if level == "sample" else 1))
    kept = weights[keep]
    gap = (old - behaviour)[keep].abs().mean()
    return (weights, sum(truncated) / len(truncated), kept.mean(), kept.max(), gap,
            sum(residuals) / len(residuals))


@pytest.mark.parametrize("level", IS_LEVELS)
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])
def test_weights_and_metrics_match_the_float64_reference(level: str, masked: bool) -> None:
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(16, 3, generator=g) - 1.0
    old = behaviour + 0.3 * torch.randn(16, 3, generator=g)  # a gap large enough that the cap bites
    mask = torch.rand(16, 3, generator=g) > 0.3 if masked else torch.ones(16, 3, dtype=torch.bool)
    mask[0] = False  # a sample with nothing kept (all padding)
    cap = 1.2
    out = truncated_importance_weights(old, behaviour, cap, level=level, mask=mask if masked else None)
    if not masked:
        mask[0] = True
    w, frac, mean, peak, before, after = _reference(old, behaviour, cap, level, mask)
    torch.testing.assert_close(out.weights.double(), w, rtol=1e-6, atol=1e-7)
    m = out.metrics
    assert float(m["is_truncated_frac"]) == pytest.approx(frac)
    assert 0 < float(m["is_truncated_frac"]) < 1
    assert float(m["is_weight_mean"]) == pytest.approx(float(mean), rel=1e-6)
    assert float(m["is_weight_max"]) == pytest.approx(float(peak), rel=1e-6)
    assert float(m["dlogp_abs_mean_before"]) == pytest.approx(float(before), rel=1e-6)
    assert float(m["dlogp_abs_mean_after"]) == pytest.approx(after, rel=1e-5)
    assert float(m["dlogp_abs_mean_after"]) < float(m["dlogp_abs_mean_before"])
    assert out.weights.max() <= cap * (1 + 1e-6) and out.weights.dtype == torch.float32
    torch.testing.assert_close(out.weights[~mask], torch.ones_like(out.weights[~mask]), rtol=0, atol=0)


def test_on_policy_weights_are_one_and_carry_no_gradient() -> None:
    lp = torch.randn(4, 2, requires_grad=True)
    out = truncated_importance_weights(lp, lp.detach().clone(), cap=2.0)
    assert torch.equal(out.weights, torch.ones(4, 2)) and not out.weights.requires_grad
    assert float(out.metrics["dlogp_abs_mean_before"]) == 0 == float(out.metrics["dlogp_abs_mean_after"])
    assert float(out.metrics["is_truncated_frac"]) == 0


def test_untruncated_weights_leave_no_gap_and_a_cap_of_one_keeps_only_downweights() -> None:
    behaviour = torch.zeros(2, 3)
    old = torch.tensor([[0.1, -0.2, 0.05], [-0.3, 0.2, 0.0]])
    out = truncated_importance_weights(old, behaviour, cap=10.0)
    torch.testing.assert_close(out.weights, old.exp())
    assert float(out.metrics["dlogp_abs_mean_after"]) == 0
    one = truncated_importance_weights(old, behaviour, cap=1.0)
    torch.testing.assert_close(one.weights, old.exp().clamp(max=1.0))


def test_bad_inputs_are_refused() -> None:
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="vs behaviour_log_probs"):
        truncated_importance_weights(a, torch.zeros(2, 2), cap=2.0)
    with pytest.raises(ValueError, match="unknown importance-weight level 'seq'"):
        truncated_importance_weights(a, a, cap=2.0, level="seq")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_importance_weights(a, a, cap=0.5)
    with pytest.raises(ValueError, match="mask"):
        truncated_importance_weights(a, a, cap=2.0, mask=torch.ones(3, 2, dtype=torch.bool))
    bad = a.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        truncated_importance_weights(bad, a, cap=2.0)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 2] = False  # a NaN the mask drops (padding) is not an error
    assert float(truncated_importance_weights(bad, a, cap=2.0, mask=keep).weights[1, 2]) == 1.0
