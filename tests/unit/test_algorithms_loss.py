"""Clipped FlowGRPO loss, KL and metrics against float64 references."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.algorithms.loss import flowgrpo_loss, kl_penalty


def _ref_loss(lp, old, adv, eps_low, eps_high):
    lp, old, adv = lp.double(), old.double(), adv.double().view(-1, 1)
    ratio = torch.exp(lp - old)
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    return terms.mean(), ratio


@pytest.mark.parametrize("clip", [1e-4, (2e-4, 3e-4), 0.2])
def test_policy_loss_and_metrics_match_reference(clip) -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 2, generator=g) - 1.0
    lp = old + 3e-4 * torch.randn(8, 2, generator=g)
    adv = torch.randn(8, generator=g)
    low, high = (clip, clip) if isinstance(clip, float) else clip
    out = flowgrpo_loss(lp, old, adv, clip)
    ref, ratio = _ref_loss(lp, old, adv, low, high)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-9)
    dlogp = (lp - old).double()
    torch.testing.assert_close(
        out.metrics["approx_kl"].double(), 0.5 * (dlogp**2).mean(), rtol=1e-5, atol=1e-12
    )
    clipfrac = ((ratio < 1 - low) | (ratio > 1 + high)).double().mean()
    assert float(out.metrics["clipfrac"]) == pytest.approx(float(clipfrac))
    assert float(out.metrics["ratio_max"]) == pytest.approx(float(ratio.max()), rel=1e-6)
    assert float(out.kl_loss) == 0.0


def test_ratio_exactly_one_and_gradient_is_minus_advantage_mean() -> None:
    old = torch.tensor([[-1.3, -0.7], [-2.0, -0.1]])
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([0.5, -2.0])
    out = flowgrpo_loss(lp, old, adv, 1e-5)
    assert torch.equal(out.ratio, torch.ones_like(out.ratio))
    assert float(out.metrics["clipfrac"]) == 0.0 and float(out.metrics["approx_kl"]) == 0.0
    out.loss.backward()
    # d/dlp of mean(-A ratio) at ratio 1 is -A / numel
    torch.testing.assert_close(lp.grad, (-adv.view(-1, 1) / 4).expand(2, 2))


def test_clipped_side_has_no_gradient() -> None:
    old = torch.zeros(1, 1)
    lp = torch.full((1, 1), 0.1, requires_grad=True)  # ratio 1.105 > 1 + eps
    out = flowgrpo_loss(lp, old, torch.tensor([1.0]), 0.01)
    out.loss.backward()
    assert float(lp.grad.abs().sum()) == 0.0
    assert float(out.metrics["clipfrac"]) == 1.0


def test_kl_term() -> None:
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(3, 4, 5, generator=g)
    ref = mean + 0.1 * torch.randn(3, 4, 5, generator=g)
    std = torch.tensor([0.5, 1.0, 2.0])
    kl = kl_penalty(mean, ref, std)
    expected = ((mean.double() - ref.double()) ** 2).mean(dim=(1, 2)) / (2 * std.double() ** 2)
    torch.testing.assert_close(kl.double(), expected, rtol=1e-6, atol=1e-9)
    lp = torch.zeros(3, 1)
    out = flowgrpo_loss(lp, lp, torch.ones(3), 0.1, beta=0.04, kl=kl)
    torch.testing.assert_close(out.loss, out.policy_loss + 0.04 * kl.mean())
    with pytest.raises(ValueError, match="kl"):
        flowgrpo_loss(lp, lp, torch.ones(3), 0.1, beta=0.04)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="advantages"):
        flowgrpo_loss(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match="clip_range"):
        flowgrpo_loss(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3), 0.0)


@pytest.mark.parametrize("level", ["token", "sample", "geometric"])
def test_truncated_importance_weights_reach_the_loss_as_the_float64_reference(level: str) -> None:
    """A rollout that sampled another policy (logp_rollout != logp_old): the surrogate's terms are weighted by
    min(exp(logp_old - logp_rollout), cap) (per transition, or one per sample), the gradient too."""
    from megatron_omni.algorithms.importance import truncated_importance_weights

    g = torch.Generator().manual_seed(3)
    old = -torch.rand(8, 2, generator=g) - 1.0
    rollout = old + 0.4 * torch.randn(8, 2, generator=g)  # large enough that the cap truncates some units
    lp = (old + 0.05 * torch.randn(8, 2, generator=g)).requires_grad_(True)
    adv = torch.randn(8, generator=g)
    cap = 1.2
    iw = truncated_importance_weights(old, rollout, cap, level)
    out = flowgrpo_loss(lp, old, adv, 0.2, is_weights=iw.weights)
    out.loss.backward()

    d = (old - rollout).double()
    unit = {"token": d, "sample": d.sum(1, keepdim=True), "geometric": d.mean(1, keepdim=True)}[level]
    w = unit.exp().clamp(max=cap).expand_as(d)
    assert 0 < int((unit.exp() > cap).sum()) < unit.numel(), "the case must truncate some units and not others"
    ref_lp = lp.detach().double().requires_grad_(True)
    ratio = torch.exp(ref_lp - old.double())
    a = adv.double().view(-1, 1)
    ref = (w * torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))).mean()
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(lp.grad.double(), ref_lp.grad, rtol=1e-5, atol=1e-9)
    unweighted = flowgrpo_loss(lp.detach(), old, adv, 0.2)
    assert float(out.loss.detach()) != pytest.approx(float(unweighted.loss), rel=1e-3)
    with pytest.raises(ValueError, match="is_weights"):
        flowgrpo_loss(lp.detach(), old, adv, 0.2, is_weights=iw.weights[:, :1])
