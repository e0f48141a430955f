"""The Qwen-Image sampling grid against diffusers' scheduler and pipeline, and against a float64 formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as diffusers_calculate_shift

from megatron_omni.algorithms.schedule import ShiftConfig, calculate_shift, model_timesteps, qwen_image_sigmas

QWEN_LIKE = {
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


def _diffusers_sigmas(num_steps: int, seq_len: int, config: dict) -> torch.Tensor:
    """What QwenImagePipeline.__call__ hands the scheduler, and the grid the scheduler builds."""
    sched = FlowMatchEulerDiscreteScheduler(**config)
    mu = diffusers_calculate_shift(
        seq_len,
        sched.config.get("base_image_seq_len", 256),
        sched.config.get("max_image_seq_len", 4096),
        sched.config.get("base_shift", 0.5),
        sched.config.get("max_shift", 1.15),
    )
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return sched.sigmas


@pytest.mark.parametrize("num_steps", [1, 2, 10, 50])
@pytest.mark.parametrize("seq_len", [16, 256, 1024, 4096, 6000])
def test_sigmas_bit_identical_to_diffusers(num_steps: int, seq_len: int) -> None:
    ours = qwen_image_sigmas(num_steps, seq_len, ShiftConfig.from_scheduler_config(QWEN_LIKE))
    ref = _diffusers_sigmas(num_steps, seq_len, QWEN_LIKE)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert torch.equal(ours, ref), (ours - ref).abs().max()


def test_shift_terminal_matches_diffusers() -> None:
    cfg = dict(QWEN_LIKE, max_image_seq_len=8192, max_shift=0.9, shift_terminal=0.02)
    ours = qwen_image_sigmas(10, 1024, ShiftConfig.from_scheduler_config(cfg))
    ref = _diffusers_sigmas(10, 1024, cfg)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-7)
    assert abs(float(ours[-2]) - 0.02) < 1e-6


def test_against_float64_formula() -> None:
    t, seq = 10, 1024
    mu = (1.15 - 0.5) / (4096 - 256) * seq + 0.5 - (1.15 - 0.5) / (4096 - 256) * 256
    assert math.isclose(calculate_shift(seq), mu, rel_tol=1e-15)
    base = np.linspace(1.0, 1.0 / t, t)
    ref = np.exp(mu) / (np.exp(mu) + (1.0 / base - 1.0))
    ours = qwen_image_sigmas(t, seq).double().numpy()
    np.testing.assert_allclose(ours[:-1], ref, rtol=1e-6, atol=1e-7)
    assert ours[0] == 1.0 and ours[-1] == 0.0
    assert np.all(np.diff(ours) < 0)


def test_model_timesteps_roundtrip_like_pipeline() -> None:
    sig = qwen_image_sigmas(10, 64)
    # The pipeline: t = scheduler.timesteps (sigma * 1000, float32), transformer gets t / 1000.
    sched_t = sig[:-1] * 1000
    torch.testing.assert_close(model_timesteps(sig[:-1]), sched_t / 1000, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_timesteps_match_the_pipeline_in_each_dtype(dtype: torch.dtype) -> None:
    # QwenImagePipeline: timestep = t.expand(b).to(latents.dtype), the transformer gets timestep / 1000.
    sched = FlowMatchEulerDiscreteScheduler(**QWEN_LIKE)
    mu = calculate_shift(1024, 256, 4096, 0.5, 1.15)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 50, 50), mu=mu)
    pipeline = torch.stack([t.expand(1).to(dtype) / 1000 for t in sched.timesteps]).flatten()
    ours = model_timesteps(sched.sigmas[:-1], dtype)
    assert ours.dtype == dtype
    assert torch.equal(ours, pipeline)
    if dtype == torch.bfloat16:  # the convention matters: bf16(sigma) misses at many grid points
        assert int((sched.sigmas[:-1].to(dtype) != pipeline).sum()) >= 5


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="use_dynamic_shifting"):
        ShiftConfig.from_scheduler_config({"use_dynamic_shifting": False})
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        ShiftConfig.from_scheduler_config(dict(QWEN_LIKE, use_karras_sigmas=True))
    with pytest.raises(ValueError, match="num_steps"):
        qwen_image_sigmas(0, 16)
