"""FlowGRPO math: the sampling grid, SDE steps and log-probs, windows, advantages, losses, CFG, the guided
velocity of a batch and the log-prob of a recorded transition (`velocity`, `transition`: they call a velocity
model passed in, any callable with diffusers' transformer keywords).

Pure torch tensor math in float32 (float64 where noted): no I/O, no torch.distributed.
"""

from megatron_omni.algorithms.advantages import Advantages, group_advantages
from megatron_omni.algorithms.cfg import true_cfg
from megatron_omni.algorithms.importance import IS_LEVELS, ImportanceWeights, truncated_importance_weights
from megatron_omni.algorithms.loss import PolicyLoss, flowgrpo_loss, kl_penalty, policy_metrics
from megatron_omni.algorithms.schedule import ShiftConfig, calculate_shift, model_timesteps, qwen_image_sigmas
from megatron_omni.algorithms.sde import (
    SDE_TYPES,
    SdeCoefficients,
    SdeStepOutput,
    sde_coefficients,
    sde_log_prob,
    sde_step,
)
from megatron_omni.algorithms.window import (
    check_window,
    sample_window_start,
    window_noise_levels,
    window_step_indices,
)

__all__ = [
    "IS_LEVELS",
    "SDE_TYPES",
    "Advantages",
    "ImportanceWeights",
    "PolicyLoss",
    "SdeCoefficients",
    "SdeStepOutput",
    "ShiftConfig",
    "calculate_shift",
    "check_window",
    "flowgrpo_loss",
    "group_advantages",
    "kl_penalty",
    "model_timesteps",
    "policy_metrics",
    "qwen_image_sigmas",
    "sample_window_start",
    "sde_coefficients",
    "sde_log_prob",
    "sde_step",
    "true_cfg",
    "truncated_importance_weights",
    "window_noise_levels",
    "window_step_indices",
]
