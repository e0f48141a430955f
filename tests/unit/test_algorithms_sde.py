"""SDE steps and log-probs against an independent float64 reference of docs/design.md section 3."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_omni.algorithms.schedule import qwen_image_sigmas
from megatron_omni.algorithms.sde import sde_coefficients, sde_log_prob, sde_step
from megatron_omni.algorithms.window import (
    check_window,
    sample_window_start,
    window_noise_levels,
    window_step_indices,
)

SIGMAS = qwen_image_sigmas(10, 64).double()


def ref_step(x, v, s, s_next, s1, a, sde_type, xi):
    """float64 reference: returns (x_next, mean, per-sample scale, per-element-mean log-prob)."""
    x, v, xi = x.double(), v.double(), xi.double()
    dt = s_next - s
    if sde_type == "sde":
        s_t = s1 if s == 1.0 else s
        std = a * math.sqrt(s / (1.0 - s_t))
        mean = x + (v + (std**2 / (2 * s)) * (x + (1 - s) * v)) * dt
        scale = std * math.sqrt(-dt)
    elif sde_type == "cps":
        std = s_next * math.sin(a * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = (1 - s_next) * x0 + math.sqrt(s_next**2 - std**2) * x1
        scale = std
    else:
        x0 = x - s * v
        score = -(x - (1 - s) * x0) / s**2
        mean = x + v * dt - 0.5 * a**2 * score * dt
        scale = a * math.sqrt(-dt)
    x_next = mean + scale * xi
    if scale == 0:
        return x_next, mean, scale, None
    if sde_type == "cps":
        lp = -((x_next - mean) ** 2).mean(dim=(1, 2))
    else:
        dens = -((x_next - mean) ** 2) / (2 * scale**2) - math.log(scale) - 0.5 * math.log(2 * math.pi)
        lp = dens.mean(dim=(1, 2))
    return x_next, mean, scale, lp


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, 8, generator=g).to(dtype)
    v = torch.randn(3, 16, 8, generator=g).to(dtype)
    xi = torch.randn(3, 16, 8, generator=g)
    return x, v, xi


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
@pytest.mark.parametrize("step", [0, 1, 4, 8])  # step 0 is sigma == 1
@pytest.mark.parametrize("a", [0.7, 1.2])
def test_step_matches_float64_reference(sde_type: str, step: int, a: float) -> None:
    x, v, xi = _inputs(step)
    s, s_next, s1 = float(SIGMAS[step]), float(SIGMAS[step + 1]), float(SIGMAS[1])
    if step == 0:
        assert s == 1.0
    if sde_type == "cps" and a > 1:
        a = 0.5  # sin(a pi/2) <= 1 keeps sqrt(s_next^2 - std^2) real
    out = sde_step(x, v, s, s_next, a, sde_type, sigma_after_one=s1, noise=xi)
    rx, rmean, rscale, rlp = ref_step(x, v, s, s_next, s1, a, sde_type, xi)
    assert out.next_latents.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    torch.testing.assert_close(out.coeffs.mean.double(), rmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.next_latents.double(), rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.coeffs.scale.double(), torch.full((3,), rscale, dtype=torch.float64))
    torch.testing.assert_close(out.log_prob.double(), rlp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_last_step_outside_window_is_euler(sde_type: str) -> None:
    """The last step (sigma_next = 0) with noise level 0 is diffusers' Euler step, bit for bit."""
    x, v, xi = _inputs(3)
    s, s_next = SIGMAS[-2].float(), SIGMAS[-1].float()
    assert float(s_next) == 0.0
    out = sde_step(
        x, v, s, s_next, 0.0, sde_type, sigma_after_one=SIGMAS[1], noise=xi, compute_log_prob=False
    )
    euler = x + (s_next - s) * v  # FlowMatchEulerDiscreteScheduler.step
    if sde_type == "cps":
        torch.testing.assert_close(out.next_latents, euler, rtol=0, atol=2e-6)
    else:
        assert torch.equal(out.next_latents, euler)
    assert float(out.coeffs.scale.abs().max()) == 0.0
    with pytest.raises(ValueError, match="deterministic"):
        sde_log_prob(out.next_latents, out.coeffs, sde_type)


def test_last_step_inside_window_reference() -> None:
    x, v, xi = _inputs(5)
    s, s_next = float(SIGMAS[-2]), 0.0
    out = sde_step(x, v, s, s_next, 1.2, "sde", sigma_after_one=float(SIGMAS[1]), noise=xi)
    _, _, _, rlp = ref_step(x, v, s, s_next, float(SIGMAS[1]), 1.2, "sde", xi)
    torch.testing.assert_close(out.log_prob.double(), rlp, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_are_upcast() -> None:
    x, v, xi = _inputs(7, torch.bfloat16)
    s, s_next, s1 = float(SIGMAS[2]), float(SIGMAS[3]), float(SIGMAS[1])
    out = sde_step(x, v, s, s_next, 1.2, "sde", sigma_after_one=s1, noise=xi)
    # reference on the exact bf16 values, in float64
    _, rmean, _, rlp = ref_step(x.double(), v.double(), s, s_next, s1, 1.2, "sde", xi)
    assert out.coeffs.mean.dtype == torch.float32
    torch.testing.assert_close(out.coeffs.mean.double(), rmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.log_prob.double(), rlp, rtol=1e-5, atol=1e-5)


def test_per_sample_sigmas_equal_separate_steps() -> None:
    """Continuous batching puts samples at different steps in one batch."""
    x, v, xi = _inputs(11)
    steps = torch.tensor([0, 3, 9])
    a = torch.tensor([1.2, 0.0, 1.2])
    batched = sde_step(
        x,
        v,
        SIGMAS[steps].float(),
        SIGMAS[steps + 1].float(),
        a,
        "sde",
        sigma_after_one=float(SIGMAS[1]),
        noise=xi,
        compute_log_prob=False,
    )
    for i in range(3):
        one = sde_step(
            x[i : i + 1],
            v[i : i + 1],
            float(SIGMAS[steps[i]]),
            float(SIGMAS[steps[i] + 1]),
            float(a[i]),
            "sde",
            sigma_after_one=float(SIGMAS[1]),
            noise=xi[i : i + 1],
            compute_log_prob=False,
        )
        assert torch.equal(batched.next_latents[i], one.next_latents[0])


@pytest.mark.parametrize("sde_type", ["sde", "dance_sde"])
def test_log_prob_equals_normal_density_mean(sde_type: str) -> None:
    x, v, xi = _inputs(13)
    out = sde_step(
        x, v, float(SIGMAS[2]), float(SIGMAS[3]), 1.2, sde_type, sigma_after_one=float(SIGMAS[1]), noise=xi
    )
    dist = torch.distributions.Normal(out.coeffs.mean.double(), out.coeffs.scale.double().view(-1, 1, 1))
    expected = dist.log_prob(out.next_latents.double()).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_recompute_gives_ratio_exactly_one(sde_type: str) -> None:
    x, v, xi = _inputs(17)
    args = (float(SIGMAS[1]), float(SIGMAS[2]), 0.5, sde_type)
    rollout = sde_step(x, v, *args, sigma_after_one=float(SIGMAS[1]), noise=xi)
    again = sde_step(
        x.clone(), v.clone(), *args, sigma_after_one=float(SIGMAS[1]), next_latents=rollout.next_latents
    )
    ratio = torch.exp(again.log_prob - rollout.log_prob)
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_log_prob_gradient_flows_to_velocity() -> None:
    x, v, xi = _inputs(19)
    v = v.clone().requires_grad_(True)
    out = sde_step(
        x, v, float(SIGMAS[2]), float(SIGMAS[3]), 1.2, "sde", sigma_after_one=float(SIGMAS[1]), noise=xi
    )
    out.log_prob.sum().backward()
    assert v.grad is not None and float(v.grad.abs().sum()) > 0


def test_bad_inputs_raise() -> None:
    x, v, xi = _inputs(0)
    with pytest.raises(ValueError, match="sde_type"):
        sde_coefficients(x, v, 0.5, 0.4, 1.0, "ddim")
    with pytest.raises(ValueError, match="sigma_after_one"):
        sde_coefficients(x, v, 1.0, 0.9, 1.0, "sde")
    with pytest.raises(ValueError, match="smaller"):
        sde_coefficients(x, v, 0.4, 0.5, 1.0, "sde")
    with pytest.raises(ValueError, match="noise"):
        sde_step(x, v, 0.5, 0.4, 1.0, "sde")
    with pytest.raises(ValueError, match="batch"):
        sde_coefficients(x, v, torch.tensor([0.5, 0.4]), 0.3, 1.0, "sde")


def test_window_sampling() -> None:
    g = torch.Generator().manual_seed(0)
    starts = {sample_window_start(10, 2, (0, 5), g) for _ in range(400)}
    assert starts == {0, 1, 2, 3}
    levels = window_noise_levels(10, 3, 2, 1.2)
    assert levels.tolist() == [0, 0, 0, 1.2000000476837158, 1.2000000476837158, 0, 0, 0, 0, 0]
    assert window_step_indices(torch.tensor([0, 3]), 2).tolist() == [[0, 1], [3, 4]]
    a = sample_window_start(10, 2, (0, 5), torch.Generator().manual_seed(5))
    b = sample_window_start(10, 2, (0, 5), torch.Generator().manual_seed(5))
    assert a == b
    with pytest.raises(ValueError, match="shorter"):
        check_window(10, 3, (0, 2))
    with pytest.raises(ValueError, match="num_steps"):
        check_window(10, 2, (0, 11))


def test_windowed_sde_step_draws_only_stochastic_rows_from_their_own_generators():
    from megatron_omni.algorithms.sde import windowed_sde_step

    torch.manual_seed(0)
    x, v = torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    sigma, sigma_next, one = torch.full((3,), 0.8), torch.full((3,), 0.6), torch.full((3,), 0.9)
    levels = torch.tensor([0.7, 0.0, 0.7])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    nxt, rows, lp = windowed_sde_step(x, v, sigma, sigma_next, one, levels, "sde", gens)
    assert rows.tolist() == [0, 2]
    for r, seed in ((0, 1), (2, 3)):
        noise = torch.randn(4, 2, generator=torch.Generator().manual_seed(seed))
        one_row = sde_step(x[r:r + 1], v[r:r + 1], sigma[r:r + 1], sigma_next[r:r + 1], levels[r:r + 1], "sde",
                           sigma_after_one=one[r:r + 1], noise=noise[None], compute_log_prob=False)
        torch.testing.assert_close(nxt[r], one_row.next_latents[0])
        want = sde_log_prob(one_row.next_latents, one_row.coeffs, "sde")
        torch.testing.assert_close(lp[rows.tolist().index(r)], want[0])
    ode = sde_step(x[1:2], v[1:2], sigma[1:2], sigma_next[1:2], 0.0, "sde", sigma_after_one=one[1:2],
                   compute_log_prob=False)
    torch.testing.assert_close(nxt[1], ode.next_latents[0])
    assert torch.equal(gens[1].get_state(), torch.Generator().manual_seed(2).get_state())  # never drawn from
