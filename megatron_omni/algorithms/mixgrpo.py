"""MixGRPO (Li et al. 2025, arXiv 2507.21802): the SDE only inside a window of steps that slides over training,
the ODE elsewhere; its Flash variant samples the ODE steps after the window with fewer evaluations.

- **The sliding window** (the reference's `progressive` strategy, `GRPOTrainingStates`): every sample of an RL
  step shares one window start; it begins at the range's low end and moves `shift` steps every
  `steps_per_move` RL steps (the paper: window 4 of 25 steps, moved by 1 every 25 iterations), and after the
  last start whose window fits the range it rolls back to the low end (`roll_back`, the reference's default)
  or stays there. Unlike the reference, whose window shrinks at the range's end, the window keeps its size.
- **Flash**: after the window's last SDE step the remaining `R` grid steps are replaced by
  `max(1, int(R ratio) - 1)` steps (the reference rebuilds the tail with `int(R ratio)` grid points:
  `dpm_post_compress_ratio`, 0.4 in the Flash script), evenly spaced in the unshifted time from the window's end
  to 0 and shifted like the grid, and sampled with the multistep DPM-Solver++ (2nd order, diffusers' and the
  reference's `midpoint` form; first order on the last step, `lower_order_final`).
  Only the window's transitions are trained, so the tail's solver changes what the images look like, never a
  recorded log-prob.

For rectified flow (`x_s = (1 - s) x0 + s eps`, alpha = 1 - s, lambda = log(alpha / s)) DPM-Solver++ of
first order is exactly the Euler step; the second order adds `-(alpha' (e^-h - 1) / 2) (x0 - x0_prev) / r`.
"""

from __future__ import annotations

import torch

from megatron_omni.algorithms.schedule import ShiftConfig, shift_sigmas


def window_start_at(step: int, window_size: int, window_range: tuple[int, int], steps_per_move: int, shift: int,
                    roll_back: bool = True) -> int:
    """The window's first step at RL step `step` (0-based), the same for every sample of the step.

    Args:
        step: RL steps done before this one.
        window_size: W, the SDE steps of the window.
        window_range: [lo, hi): every window lies inside it (starts lo .. hi - W).
        steps_per_move: RL steps between two moves (the reference's `iters_per_group`).
        shift: steps the window moves each time (`prog_overlap_step`; the window's size when not overlapping).
        roll_back: past the last start, begin again at lo (else stay at the last start).

    Returns:
        The start k, lo <= k <= hi - W.
    """
    lo, hi = window_range
    if step < 0 or window_size < 1 or steps_per_move < 1 or shift < 1:
        raise ValueError(f"step={step}, window_size={window_size}, steps_per_move={steps_per_move} and "
                         f"shift={shift} must be >= 0, >= 1, >= 1 and >= 1")
    if not 0 <= lo < hi or hi - lo < window_size:
        raise ValueError(f"window_range {window_range} does not hold a window of {window_size} steps")
    starts = (hi - window_size - lo) // shift + 1  # lo, lo + shift, ... <= hi - W
    moves = step // steps_per_move
    return lo + shift * (moves % starts if roll_back else min(moves, starts - 1))


def flash_tail_steps(num_steps: int, window_end: int, ratio: float) -> int:
    """The ODE steps Flash samples after a window ending at grid index `window_end` (exclusive) of `num_steps`:
    `max(1, int((num_steps - window_end) * ratio) - 1)` (the reference's `int(R ratio)` grid points of the
    rebuilt tail, never fewer than one step). `ratio` in (0, 1]; a window ending at the grid's end leaves no
    tail (0)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if not 0 < window_end <= num_steps:
        raise ValueError(f"window_end {window_end} outside (0, {num_steps}]")
    remaining = num_steps - window_end
    return 0 if remaining == 0 else max(1, int(remaining * ratio) - 1)


def flash_grid(sigmas: torch.Tensor, window_end: int, tail_steps: int, image_seq_len: int,
               shift: ShiftConfig | None = None) -> torch.Tensor:
    """A sampling grid whose steps from `window_end` on are re-spaced into `tail_steps` steps.

    Args:
        sigmas: [T + 1] the full grid (`qwen_image_sigmas(T, image_seq_len, shift)`).
        window_end: the index where the tail begins (the window's end); its sigma is kept bit for bit.
        tail_steps: M >= 1 steps from there to 0.
        image_seq_len, shift: the grid's shift (its `shift_terminal` must be unset).

    Returns:
        [window_end + M + 1] float32: sigmas[: window_end + 1], then M - 1 shifted points of
        `linspace(1 - window_end / T, 0, M + 1)`, then 0.
    """
    shift = shift or ShiftConfig()
    if shift.shift_terminal:
        raise ValueError("the Flash tail re-spaces the grid without shift_terminal")
    t = sigmas.shape[0] - 1
    if not 0 < window_end < t:
        raise ValueError(f"window_end {window_end} must leave a tail in the grid of {t} steps")
    if tail_steps < 1:
        raise ValueError(f"tail_steps must be >= 1, got {tail_steps}")
    times = torch.linspace(1.0 - window_end / t, 0.0, tail_steps + 1, dtype=torch.float64)[1:-1].to(torch.float32)
    inner = shift_sigmas(times, image_seq_len, shift) if times.numel() else times
    return torch.cat([sigmas[: window_end + 1].float(), inner.to(sigmas.device),
                      torch.zeros(1, dtype=torch.float32, device=sigmas.device)])


def dpm_solver_pp_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor,
                       prev_x0: torch.Tensor | None = None, sigma_prev: torch.Tensor | None = None,
                       second_order: torch.Tensor | bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One multistep DPM-Solver++ step of a rectified flow (x0 parameterisation), row by row.

    Args:
        latents: x at sigma, [B, ...]; velocity: v there, [B, ...] (after CFG).
        sigma, sigma_next: [B], 1 >= sigma > sigma_next >= 0.
        prev_x0: [B, ...] the previous step's x0 prediction (None: first order everywhere).
        sigma_prev: [B] the previous step's sigma (> sigma).
        second_order: [B] bool (or one bool): rows allowed the second order; a row takes it only with a previous
            step below sigma 1 and sigma_next > 0 (the last step is first order: x0 itself).

    Returns:
        (x at sigma_next [B, ...] float32, this step's x0 prediction [B, ...] float32, for the next step).
    """
    if latents.shape != velocity.shape:
        raise ValueError(f"latents {tuple(latents.shape)} vs velocity {tuple(velocity.shape)}")
    b = latents.shape[0]
    x, v = latents.float(), velocity.float()
    s, s_next = sigma.float().reshape(b), sigma_next.float().reshape(b)
    if bool((s_next >= s).any()) or bool((s_next < 0).any()) or bool((s > 1).any()):
        raise ValueError("need 1 >= sigma > sigma_next >= 0")

    def col(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *([1] * (x.ndim - 1)))

    x0 = x - col(s) * v
    final = s_next == 0
    safe_next = torch.where(final, torch.full_like(s_next, 0.5), s_next)  # lambda(0) is +inf; those rows take x0
    lam = torch.log(1 - s) - torch.log(s)
    h = torch.log(1 - safe_next) - torch.log(safe_next) - lam
    coeff = (1 - safe_next) * torch.expm1(-h)  # alpha' (e^-h - 1)
    out = col(safe_next / s) * x - col(coeff) * x0
    if prev_x0 is not None:
        if sigma_prev is None:
            raise ValueError("prev_x0 needs sigma_prev")
        s_prev = sigma_prev.float().reshape(b)
        use = torch.as_tensor(second_order, device=x.device).expand(b) & (s_prev < 1) & ~final
        if bool(use.any()):
            safe_prev = torch.where(use, s_prev, torch.full_like(s_prev, 0.5))
            r = (lam - (torch.log(1 - safe_prev) - torch.log(safe_prev))) / h
            d1 = (x0 - prev_x0.float()) / col(torch.where(use, r, torch.ones_like(r)))
            out = torch.where(col(use), out - 0.5 * col(coeff) * d1, out)
    return torch.where(col(final), x0, out), x0


def second_order_allowed(step_index: int, grid_steps: int) -> bool:
    """Whether the 2nd-order multistep solver may take its second order at `step_index` of a grid of `grid_steps`
    steps: on every step but the last (diffusers' `lower_order_final`; its `lower_order_second` caps a 3rd-order
    solver at the second order, which a 2nd-order one is anyway)."""
    return step_index < grid_steps - 1
