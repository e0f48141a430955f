"""What the GPU tests of vLLM-Omni engines share: the skip (with its printed reason) when this machine cannot
run them."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_omni.parallel import platform


def require_vllm_omni_gpu(cpu_parts: str) -> None:
    """Skip, printing why, unless a CUDA device and vLLM + vLLM-Omni are here (`cpu_parts`: where the parts
    that run without a GPU are tested); then turn TF32 off so fp32 comparisons are meaningful."""
    reason = None
    if not platform.has_gpu():
        reason = f"no CUDA device: the vLLM-Omni engine needs a GPU (CPU parts: {cpu_parts})"
    else:
        missing = [m for m in ("vllm", "vllm_omni") if importlib.util.find_spec(m) is None]
        if missing:
            reason = f"{missing} not installed on this GPU machine"
    if reason:
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
