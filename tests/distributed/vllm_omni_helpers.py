"""What the vLLM-Omni pipeline-class tests share (`test_rollout_vllm_omni.py`, `test_image_vllm_omni.py`,
`test_wan_vllm_omni.py`, `test_qwen_image_edit_vllm_omni.py`): perturbed weights for a sync, vLLM-Omni's request
batch for a call, and the field-by-field comparison of two trajectories."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_omni.rollout.base import SamplingParams, Trajectory


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """`state` with N(0, 0.05^2) noise from `seed` added to every tensor (weights a sync must move)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def request_batch(prompts: Sequence[str], params: SamplingParams, seeds: Sequence[int]):
    """vLLM-Omni's `DiffusionRequestBatch` of one sample per seed, as our client sends them: sample i is prompt
    `prompts[i // 2]` (groups of two) with seed `seeds[i]`, row i, group i // 2."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    from megatron_omni.rollout.vllm_omni.pipeline import EXTRA_KEY, sample_prompt, sampling_extra

    sp = OmniDiffusionSamplingParams(height=params.height, width=params.width, num_inference_steps=params.num_steps,
                                     extra_args={EXTRA_KEY: sampling_extra(params)})
    reqs = [OmniDiffusionRequest(prompt=sample_prompt(prompts[i // 2], s, i, i // 2), sampling_params=sp,
                                 request_id=f"r{i}") for i, s in enumerate(seeds)]
    return DiffusionRequestBatch(requests=reqs)


def trajectory_diff(a: Trajectory, b: Trajectory, fields: Sequence[str], optional: Sequence[str] = (),
                    meta: Sequence[str] = ("prompts", "img_shape", "cfg_rescale")) -> dict[str, float]:
    """Max |a - b| per tensor field of two trajectories; an `optional` field (None on a call without it) is 0 when
    both lack it and inf when only one does; `meta` is 1.0 when any of the `meta` attributes differ, else 0."""
    out = {f: float((getattr(a, f).float() - getattr(b, f).float()).abs().max()) for f in fields}
    for f in optional:
        x, y = getattr(a, f), getattr(b, f)
        out[f] = (0.0 if x is None and y is None else float("inf") if x is None or y is None
                  else float((x.float() - y.float()).abs().max()))
    out["meta"] = float(any(getattr(a, m) != getattr(b, m) for m in meta))
    return out
