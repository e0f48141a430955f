"""Qwen-Image's "true CFG": guided velocity, rescaled per token to the conditional velocity's norm.

`v = v_neg + g (v_pos - v_neg)`, then `v *= ||v_pos|| / ||v||` with norms over the channel (last) axis
of each token, as `QwenImagePipeline.__call__` does it. Computed in float32.
"""

from __future__ import annotations

import torch


def true_cfg(v_pos: torch.Tensor, v_neg: torch.Tensor, guidance_scale: float | torch.Tensor,
             rescale: bool = True) -> torch.Tensor:
    """Classifier-free guidance with per-token norm rescale (`rescale=False`: the plain guided velocity
    `v_neg + g (v_pos - v_neg)`, as `StableDiffusion3Pipeline` and flow_grpo's SD3 sampler guide).

    Args:
        v_pos: [B, L, C] velocity with the prompt.
        v_neg: [B, L, C] velocity with the negative prompt.
        guidance_scale: g, a scalar or [B].
        rescale: rescale each token to the conditional velocity's norm (Qwen-Image).

    Returns:
        [B, L, C] float32 guided velocity.
    """
    if v_pos.shape != v_neg.shape:
        raise ValueError(f"v_pos {tuple(v_pos.shape)} vs v_neg {tuple(v_neg.shape)}")
    pos = v_pos.float()
    neg = v_neg.float()
    g = torch.as_tensor(guidance_scale, dtype=torch.float32, device=pos.device)
    if g.ndim:
        if g.numel() != pos.shape[0]:
            raise ValueError(f"guidance_scale has {g.numel()} values for a batch of {pos.shape[0]}")
        g = g.view(-1, *([1] * (pos.ndim - 1)))
    comb = neg + g * (pos - neg)
    if not rescale:
        return comb
    cond_norm = torch.norm(pos, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)
