"""DiffusionNFT's loss and gradient against a float64 reference written from NVlabs' train_nft_sd3.py formulas
(implicit positive/negative velocities, x0-prediction errors over their detached mean absolute error, the reward's
optimality probability), its reward map, its old policy's decay schedules and its training noise levels."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.algorithms.nft import (
    nft_loss,
    noised_latents,
    old_policy_decay,
    optimality_probability,
    training_sigmas,
)


def _reference(v, v_old, x0, xt, t, r, beta, c, kl_beta=0.0, v_ref=None):
    """float64, term by term as the reference script computes it."""
    t = t.view(-1, 1, 1)
    pos = beta * v + (1 - beta) * v_old
    neg = (1 + beta) * v_old - beta * v
    x0_pos, x0_neg = xt - t * pos, xt - t * neg
    w_pos = (x0_pos - x0).abs().mean(dim=(1, 2), keepdim=True).clamp(min=1e-5).detach()
    w_neg = (x0_neg - x0).abs().mean(dim=(1, 2), keepdim=True).clamp(min=1e-5).detach()
    l_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=(1, 2))
    l_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=(1, 2))
    loss = ((r * l_pos / beta + (1 - r) * l_neg / beta) * c).mean()
    if kl_beta:
        loss = loss + kl_beta * ((v - v_ref) ** 2).mean(dim=(1, 2)).mean()
    return loss


def _batch(seed: int):
    """B = 5 points: clean latents, noise levels in (0, 1], noise, the old velocity and a drifted current one."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.1], dtype=torch.float64)
    xt = noised_latents(x0, t, torch.randn(5, 6, 4, generator=g, dtype=torch.float64)).double()
    v_old = torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    v = v_old + 0.1 * torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    r = optimality_probability(torch.tensor([2.0, -1.0, 0.0, 7.0, -5.5]), 5.0).double()
    return x0, t, xt, v_old, v, r


@pytest.mark.parametrize("beta,kl_beta", [(1.0, 0.0), (0.1, 0.0), (0.1, 1e-2)])
def test_loss_and_gradient_match_the_float64_reference(beta: float, kl_beta: float) -> None:
    x0, t, xt, v_old, v64, r = _batch(0)
    v_ref = v_old + 0.05
    ref_param = v64.clone().requires_grad_(True)
    ref = _reference(ref_param, v_old, x0, xt, t, r, beta, 5.0, kl_beta, v_ref)
    ref.backward()
    param = v64.float().clone().requires_grad_(True)
    out = nft_loss(param, v_old.float(), x0.float(), xt.float(), t.float(), r.float(), beta, 5.0,
                   kl_beta=kl_beta, ref_velocity=v_ref.float() if kl_beta else None)
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(param.grad.double(), ref_param.grad, rtol=1e-4, atol=1e-7)
    assert float(out.metrics["old_deviate"]) == pytest.approx(float(((v64 - v_old) ** 2).mean()), rel=1e-5)
    assert float(out.metrics["reward_weight_mean"]) == pytest.approx(float(r.mean()), rel=1e-6)


def test_positive_samples_pull_toward_themselves_and_negative_ones_away() -> None:
    """One gradient step on the velocity lowers the positive policy's x0 error when r = 1 and raises the
    current policy's own x0 error when r = 0 (the implicit negative is pushed toward the sample)."""
    x0, t, xt, v_old, _, _ = _batch(1)
    tt = t.view(-1, 1, 1).float()

    def x0_error(v: torch.Tensor) -> float:
        return float(((xt.float() - tt * v - x0.float()) ** 2).mean())

    for r, sign in ((1.0, -1), (0.0, 1)):
        v = v_old.float().clone().requires_grad_(True)
        nft_loss(v, v_old.float(), x0.float(), xt.float(), t.float(), torch.full((5,), r), 1.0, 5.0).loss.backward()
        stepped = v.detach() - 1e-3 * v.grad
        assert sign * (x0_error(stepped) - x0_error(v_old.float())) > 0, r


def test_optimality_probability_modes() -> None:
    adv = torch.tensor([-7.0, -2.5, 0.0, 1.0, 5.0])
    torch.testing.assert_close(optimality_probability(adv, 5.0), torch.tensor([0.0, 0.25, 0.5, 0.6, 1.0]))
    torch.testing.assert_close(optimality_probability(adv, 5.0, "positive_only"),
                               torch.tensor([0.5, 0.5, 0.5, 0.6, 1.0]))
    torch.testing.assert_close(optimality_probability(adv, 5.0, "negative_only"),
                               torch.tensor([0.0, 0.25, 0.5, 0.5, 0.5]))
    # the reference's "binary": sign(A) before the map onto [0, 1]
    torch.testing.assert_close(optimality_probability(adv, 5.0, "binary"), torch.tensor([0.4, 0.4, 0.5, 0.6, 0.6]))
    with pytest.raises(ValueError, match="adv mode"):
        optimality_probability(adv, 5.0, "one_only")


@pytest.mark.parametrize("schedule,values", [
    ((0, 0.0, 0.0), {0: 0.0, 500: 0.0}),  # type 0: the old policy is always the current one
    ((0, 0.001, 0.5), {0: 0.0, 10: 0.01, 499: 0.499, 800: 0.5}),  # type 1 (the default)
    ((75, 0.0075, 0.999), {74: 0.0, 75: 0.0, 76: 0.0075, 175: 0.75, 300: 0.999}),  # type 2 (OCR)
])
def test_old_policy_decay_follows_the_reference_schedules(schedule, values) -> None:
    for update, expected in values.items():
        assert old_policy_decay(update, *schedule) == pytest.approx(expected), update
    with pytest.raises(ValueError, match="cap"):
        old_policy_decay(3, 0, 0.1, 1.0)


def test_training_sigmas_are_distinct_grid_levels_per_sample() -> None:
    grid = torch.tensor([[1.0, 0.9, 0.7, 0.4, 0.0], [1.0, 0.8, 0.6, 0.2, 0.0]])
    picked = training_sigmas(grid, 3, torch.Generator().manual_seed(0))
    assert picked.shape == (2, 3)
    for row, levels in zip(grid, picked):
        assert len(set(levels.tolist())) == 3 and set(levels.tolist()) <= set(row[:-1].tolist())
    assert torch.equal(picked, training_sigmas(grid, 3, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="count"):
        training_sigmas(grid, 5, torch.Generator())


def test_bad_inputs_raise() -> None:
    x = torch.zeros(2, 3, 1)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(x, x, x, x, torch.ones(2), torch.ones(2), 0.0, 5.0)
    with pytest.raises(ValueError, match="old_velocity"):
        nft_loss(x, x[:1], x, x, torch.ones(2), torch.ones(2), 1.0, 5.0)
    with pytest.raises(ValueError, match="ref_velocity"):
        nft_loss(x, x, x, x, torch.ones(2), torch.ones(2), 1.0, 5.0, kl_beta=0.1)
    with pytest.raises(ValueError, match="sigma"):
        noised_latents(x, torch.ones(3), x)
