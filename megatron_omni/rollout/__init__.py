"""Rollout engines: the `RolloutEngine` protocol and `Trajectory` record, the embedded diffusers engine,
and the shared velocity / log-prob recompute code the trainer reuses."""

from megatron_omni.algorithms.transition import Recomputed, recompute_log_probs
from megatron_omni.algorithms.velocity import VelocityModel, guided_batch, pad_text
from megatron_omni.rollout.base import FinishedSample, RolloutEngine, SamplingParams, Trajectory

__all__ = [
    "FinishedSample",
    "Recomputed",
    "RolloutEngine",
    "SamplingParams",
    "Trajectory",
    "VelocityModel",
    "guided_batch",
    "pad_text",
    "recompute_log_probs",
]
