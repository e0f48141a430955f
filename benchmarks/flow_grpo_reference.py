"""flow_grpo's SDE step with its log-probability, re-implemented from its equations (docs/design.md section 4;
flow_grpo's `sde_step_with_logprob`), not from our code: the reference that benchmarks/rollout.py's flow_grpo-style
loop and tests/unit/test_sd3_engine.py's comparison with flow_grpo's SD3 sampling share.

With sigma s at this step, s' at the next (dt = s' - s < 0), s_max the grid's second sigma (used where s = 1)
and noise level a:

    std_dev_t        = a sqrt(s / (1 - (s_max if s == 1 else s)))
    prev_sample_mean = x (1 + std_dev_t^2 / (2 s) dt) + v (1 + std_dev_t^2 (1 - s) / (2 s)) dt
    prev_sample      = prev_sample_mean + std_dev_t sqrt(-dt) xi,   xi ~ N(0, I)
    log_prob         = mean over the elements of log N(prev_sample; prev_sample_mean, (std_dev_t sqrt(-dt))^2)
"""

from __future__ import annotations

import math

import torch


def flow_grpo_sde_step(sample: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor, sigma_prev: torch.Tensor,
                       sigma_max: torch.Tensor, noise_level: float, noise: torch.Tensor | None = None,
                       prev_sample: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of every sample of `sample` [B, ...] (fp32) with velocity `model_output` [B, ...]: returns
    (prev_sample, prev_sample_mean, log_prob [B]). `noise` xi [B, ...] draws the sample; `prev_sample` given instead
    scores a recorded one (flow_grpo's recompute)."""
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    scale = std_dev_t * torch.sqrt(-1 * dt)
    if prev_sample is None:
        if noise is None:
            raise ValueError("pass the noise to draw a sample, or prev_sample to score one")
        prev_sample = prev_sample_mean + scale * noise
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * scale**2) - torch.log(scale)
                - math.log(math.sqrt(2 * math.pi)))
    return prev_sample, prev_sample_mean, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
