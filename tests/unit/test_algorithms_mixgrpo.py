"""MixGRPO's sliding window schedule, the Flash tail's grid and its multistep DPM-Solver++ against diffusers'
DPMSolverMultistepScheduler (flow sigmas, dpmsolver++, 2nd order, midpoint), and the embedded engine sampling a
Flash trajectory with fewer ODE evaluations after the window."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.algorithms.mixgrpo import (
    dpm_solver_pp_step,
    flash_grid,
    flash_tail_steps,
    second_order_allowed,
    window_start_at,
)
from megatron_omni.algorithms.schedule import qwen_image_sigmas


def test_window_slides_every_few_steps_and_rolls_back() -> None:
    # window 2 in [0, 8): starts 0..6; one step every 3 RL steps
    starts = [window_start_at(s, 2, (0, 8), steps_per_move=3, shift=1) for s in range(24)]
    assert starts == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6, 0, 0, 0]
    stay = [window_start_at(s, 2, (0, 8), 3, 1, roll_back=False) for s in (18, 21, 60)]
    assert stay == [6, 6, 6]
    # moving by the window's size (the reference without overlap) from a range's low end: 2, 4, 6, back to 2
    assert [window_start_at(s, 2, (2, 9), 1, 2) for s in range(5)] == [2, 4, 6, 2, 4]
    for s in range(40):  # every window fits the range
        k = window_start_at(s, 3, (1, 9), 2, 2)
        assert 1 <= k and k + 3 <= 9
    with pytest.raises(ValueError, match="window_range"):
        window_start_at(0, 4, (0, 3), 1, 1)
    with pytest.raises(ValueError, match="steps_per_move"):
        window_start_at(0, 2, (0, 8), 0, 1)


def test_flash_tail_is_shorter_and_keeps_the_grid_before_it() -> None:
    grid = qwen_image_sigmas(10, 64)
    assert flash_tail_steps(10, 4, 0.4) == 1  # int(6 * 0.4) = 2 grid points: 1 step
    assert flash_tail_steps(25, 4, 0.4) == 7  # the paper's setting: 21 steps left -> 8 points, 7 steps
    assert flash_tail_steps(10, 2, 0.5) == 3 and flash_tail_steps(10, 10, 0.4) == 0
    tail = flash_grid(grid, 4, 3, 64)
    assert tail.shape == (4 + 3 + 1,)
    assert torch.equal(tail[:5], grid[:5])  # the window's sigmas, bit for bit
    assert bool((tail[1:] < tail[:-1]).all()) and float(tail[-1]) == 0.0
    # the tail's points are the grid's shift of evenly spaced times: 3 steps over the last 6 take every other one
    torch.testing.assert_close(tail[5:7], grid[6:9:2], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="tail"):
        flash_grid(grid, 10, 1, 64)


def test_dpm_solver_first_order_is_euler() -> None:
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    s, s_next = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.7, 0.3, 0.0])
    out, x0 = dpm_solver_pp_step(x, v, s, s_next)
    torch.testing.assert_close(out, x + (s_next - s).view(-1, 1, 1) * v, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x0, x - s.view(-1, 1, 1) * v)


def test_dpm_solver_matches_diffusers_multistep_scheduler() -> None:
    """The same random velocities through diffusers' scheduler (its grid replaced by a Flash grid) and through
    our step with each call's previous x0 and the lower-order rules (first order on the first step, which has
    no previous x0, and on the last), over grids of 12 and 16 steps."""
    from diffusers import DPMSolverMultistepScheduler

    for steps in (12, 16):
        sched = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                            algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                            lower_order_final=True, final_sigmas_type="zero", flow_shift=1.0)
        sched.set_timesteps(steps)
        grid = flash_grid(qwen_image_sigmas(steps + 4, 64), 4, steps - 4, 64)
        sched.sigmas = grid.clone()
        sched.set_begin_index(0)
        g = torch.Generator().manual_seed(steps)
        x_ref = x = torch.randn(2, 8, 4, generator=g)
        prev = None
        for i in range(steps):
            v = torch.randn(2, 8, 4, generator=g)
            x_ref = sched.step(v, sched.timesteps[i], x_ref).prev_sample
            x, prev_new = dpm_solver_pp_step(x, v, grid[i].expand(2), grid[i + 1].expand(2), prev,
                                             grid[i - 1].expand(2) if i else None,
                                             second_order_allowed(i, steps))
            prev = prev_new
            torch.testing.assert_close(x, x_ref, rtol=1e-4, atol=1e-5, msg=f"{steps} steps, step {i}")


def test_engine_samples_flash_with_fewer_evaluations_after_the_window(tiny_pipeline_dir: str) -> None:
    """The embedded engine with a fixed window at steps [2, 4) of 10: plain MixGRPO runs 10 forwards, Flash
    (tail 2) 6, on a grid whose first 5 sigmas are the full grid's; the window's transitions and log-probs are
    the same as without Flash (only the tail differs), the trainer's recompute agrees with them, and the images
    differ (the tail sampled otherwise)."""
    from dataclasses import replace

    from megatron_omni.algorithms.transition import recompute_log_probs
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine

    engine = DiffusersRolloutEngine(tiny_pipeline_dir, max_batch_size=4)
    plain = SamplingParams(height=32, width=32, num_steps=10, noise_level=1.0, window_size=2, window_range=(0, 8),
                           window_start=2)
    runs = {}
    for name, params in (("plain", plain), ("flash", replace(plain, tail_steps=2))):
        before = engine.stats["forwards"]
        runs[name] = engine.generate(["a red cube"], params, group_size=2, seeds=[7, 8])
        runs[name + "_forwards"] = engine.stats["forwards"] - before
    plain_t, flash_t = runs["plain"], runs["flash"]
    assert (runs["plain_forwards"], runs["flash_forwards"]) == (10, 6)
    assert flash_t.sigmas.shape == (2, 7) and torch.equal(flash_t.sigmas[:, :5], plain_t.sigmas[:, :5])
    assert torch.equal(flash_t.latents, plain_t.latents) and torch.equal(flash_t.log_probs, plain_t.log_probs)
    rec = recompute_log_probs(flash_t, engine.transformer)
    torch.testing.assert_close(rec.log_probs, flash_t.log_probs, rtol=0, atol=1e-5)
    assert float((flash_t.images - plain_t.images).abs().max()) > 1e-3
    assert flash_t.final_latents.shape == flash_t.latents.shape[:1] + flash_t.latents.shape[2:]
    with pytest.raises(ValueError, match="window_start"):
        SamplingParams(num_steps=10, window_size=2, tail_steps=2)
