"""What the CUDA tests of our own modules share: the skip (with its printed reason) without a CUDA device,
and a one-rank process group on it (NCCL, through the platform)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform


def require_cuda(what: str) -> None:
    """Skip, printing why, unless a CUDA device is here; then turn TF32 off (fp32 references stay fp32)."""
    if not platform.has_gpu():
        reason = f"no CUDA device: {what} runs on the lent GPU machine (tools/gpu_check.sh)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def require_module(name: str, what: str) -> None:
    """Skip, printing why, when `name` is not importable on this GPU machine."""
    if importlib.util.find_spec(name) is None:
        reason = f"{name} is not installed on this GPU machine: {what} needs it"
        print(f"SKIP: {reason}")
        pytest.skip(reason)


def one_rank_groups():
    """Process groups of a one-rank job on this GPU (initialised once per process)."""
    if not torch.distributed.is_initialized():
        platform.init_distributed(rank=0, world_size=1)
    return build_parallel_groups(ParallelLayout(tp=1))
