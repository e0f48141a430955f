"""GRPO-Guard's loss and gradient against a float64 reference written from the paper's RatioNorm form
(`log ratio = mean((mu - mu_old) eps)`, eps the recorded noise; each row's loss divided by |dt|), on hand-made
transitions whose log-probs come from the `sde` step's Gaussian density."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_omni.algorithms.grpo_guard import grpo_guard_loss
from megatron_omni.algorithms.loss import flowgrpo_loss


def _gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element-mean log density of x_next under N(mean, scale^2) (the `sde` step's log-prob), [B]."""
    s = scale.view(-1, 1, 1)
    dens = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return dens.mean(dim=(1, 2))


def _batch(seed: int, drift: float):
    """B = 6 transitions of [4, 3] latents at mixed steps: old means, recorded noise and next latents, a current
    mean that drifted by `drift`, scales std sqrt(-dt), dt and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    old_mean = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    dt = -torch.tensor([0.05, 0.1, 0.2, 0.05, 0.1, 0.3], dtype=torch.float64)
    std = torch.tensor([0.4, 0.7, 1.0, 1.3, 0.5, 0.9], dtype=torch.float64)
    scale = std * torch.sqrt(-dt)
    eps = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    x_next = old_mean + scale.view(-1, 1, 1) * eps
    mean = old_mean + drift * torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0, 0.9, -0.1], dtype=torch.float64)
    return old_mean, mean, x_next, eps, scale, dt, adv


def _reference(mean, old_mean, eps, dt, adv, low, high):
    """float64: RatioNorm ratio exp(mean((mu - mu_old) eps)), clipped surrogate per row / |dt|, mean."""
    ratio = torch.exp(((mean - old_mean) * eps).mean(dim=(1, 2)))
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    return (terms / dt.abs()).mean(), ratio


@pytest.mark.parametrize("clip", [0.005, (0.002, 0.008)])
def test_loss_and_gradient_match_the_float64_reference(clip) -> None:
    old_mean, mean64, x_next, eps, scale, dt, adv = _batch(0, drift=0.05)
    low, high = (clip, clip) if isinstance(clip, float) else clip
    ref_param = mean64.clone().requires_grad_(True)
    ref_loss, ref_ratio = _reference(ref_param, old_mean, eps, dt, adv, low, high)
    ref_loss.backward()

    param = mean64.float().clone().requires_grad_(True)
    lp = _gaussian_log_prob(x_next.float(), param, scale.float())
    old_lp = _gaussian_log_prob(x_next.float(), old_mean.float(), scale.float())
    out = grpo_guard_loss(lp, old_lp, adv.float(), param, old_mean.float(), scale.float(), dt.float(), clip)
    out.loss.backward()

    # Some rows are clipped and some are not, so both branches (and the zero gradient of the clipped) count.
    clipped = (ref_ratio < 1 - low) | (ref_ratio > 1 + high)
    assert 0 < int(clipped.sum()) < 6, ref_ratio
    torch.testing.assert_close(out.ratio.double(), ref_ratio, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(param.grad.double(), ref_param.grad, rtol=2e-4, atol=1e-6)
    assert float(out.metrics["clipfrac"]) == pytest.approx(float(clipped.double().mean()))
    bias = ((mean64 - old_mean) ** 2).mean(dim=(1, 2)) / (2 * scale**2)
    assert float(out.metrics["ratio_mean_bias"]) == pytest.approx(float(bias.mean()), rel=1e-4)


def test_at_the_old_policy_the_ratio_is_one_and_steps_are_reweighted_by_dt() -> None:
    """With mu = mu_old the normalised ratio is exactly 1; the gradient is FlowGRPO's multiplied per row by
    scale / |dt| (RatioNorm's scale times the reweighting), which is what separates the two rules."""
    old_mean, _, x_next, _, scale, dt, adv = _batch(1, drift=0.0)
    p_guard = old_mean.float().clone().requires_grad_(True)
    p_flow = old_mean.float().clone().requires_grad_(True)
    old_lp = _gaussian_log_prob(x_next.float(), old_mean.float(), scale.float())
    guard = grpo_guard_loss(_gaussian_log_prob(x_next.float(), p_guard, scale.float()), old_lp, adv.float(), p_guard,
                            old_mean.float(), scale.float(), dt.float(), 0.2)
    flow = flowgrpo_loss(_gaussian_log_prob(x_next.float(), p_flow, scale.float()), old_lp, adv.float(), 0.2)
    guard.loss.backward()
    flow.loss.backward()
    assert torch.equal(guard.ratio, torch.ones(6))
    weight = (scale / dt.abs()).float().view(-1, 1, 1)
    torch.testing.assert_close(p_guard.grad, p_flow.grad * weight, rtol=1e-5, atol=1e-8)


def test_kl_term_and_bad_inputs() -> None:
    old_mean, mean, x_next, _, scale, dt, adv = _batch(2, drift=0.01)
    f = [t.float() for t in (mean, old_mean, scale, dt, adv)]
    lp = _gaussian_log_prob(x_next.float(), f[0], f[2])
    kl = torch.rand(6)
    out = grpo_guard_loss(lp, lp, f[4], f[0], f[1], f[2], f[3], 0.1, beta=0.3, kl=kl)
    torch.testing.assert_close(out.loss, out.policy_loss + 0.3 * kl.mean())
    with pytest.raises(ValueError, match="kl"):
        grpo_guard_loss(lp, lp, f[4], f[0], f[1], f[2], f[3], 0.1, beta=0.3)
    with pytest.raises(ValueError, match="scale > 0"):
        grpo_guard_loss(lp, lp, f[4], f[0], f[1], torch.zeros(6), f[3], 0.1)
    with pytest.raises(ValueError, match="dt must be < 0"):
        grpo_guard_loss(lp, lp, f[4], f[0], f[1], f[2], -f[3], 0.1)
    with pytest.raises(ValueError, match=r"\[B\]"):
        grpo_guard_loss(lp[:, None], lp[:, None], f[4], f[0], f[1], f[2], f[3], 0.1)


def test_importance_weights_multiply_each_rows_term() -> None:
    """With truncated importance weights [B] each row's clipped term (over its |dt|) is weighted; loss and
    gradient against the float64 reference."""
    old_mean, mean64, x_next, eps, scale, dt, adv = _batch(1, drift=0.05)
    w = torch.linspace(0.5, 1.5, mean64.shape[0], dtype=torch.float64)
    ref_param = mean64.clone().requires_grad_(True)
    ratio = torch.exp(((ref_param - old_mean) * eps).mean(dim=(1, 2)))
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.005, 1 + 0.005))
    ref_loss = (w * terms / dt.abs()).mean()
    ref_loss.backward()
    param = mean64.float().clone().requires_grad_(True)
    lp = _gaussian_log_prob(x_next.float(), param, scale.float())
    old_lp = _gaussian_log_prob(x_next.float(), old_mean.float(), scale.float())
    out = grpo_guard_loss(lp, old_lp, adv.float(), param, old_mean.float(), scale.float(), dt.float(), 0.005,
                          is_weights=w.float())
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref_loss, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(param.grad.double(), ref_param.grad, rtol=2e-4, atol=1e-6)
