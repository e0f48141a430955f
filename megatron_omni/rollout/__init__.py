"""Rollout engines: the `RolloutEngine` protocol and `Trajectory` record, the embedded diffusers engine,
and the shared velocity / log-prob recompute code the trainer reuses."""

from megatron_omni.rollout.base import FinishedSample, RolloutEngine, SamplingParams, Trajectory
from megatron_omni.rollout.logprob import Recomputed, recompute_log_probs
from megatron_omni.rollout.velocity import VelocityModel, guided_velocity, pad_text

__all__ = [
    "FinishedSample",
    "Recomputed",
    "RolloutEngine",
    "SamplingParams",
    "Trajectory",
    "VelocityModel",
    "guided_velocity",
    "pad_text",
    "recompute_log_probs",
]
