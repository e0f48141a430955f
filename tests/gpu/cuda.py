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


# The dry-run planner predicts compute time at DEFAULT_MFU of GPUS[...].peak_bf16_flops (989 TFLOP/s on H100,
# H200 and H800) unless a GPU check's measured figure is passed (`--mfu-from`). The 20B block's throughput is held
# to that assumption with a stated margin: batch 1 (the recipes' micro-batch, the figure `--mfu-from` reads) must
# reach at least (1 - MFU_MARGIN) of DEFAULT_MFU, else every predicted compute time is off by more than 2x; and
# no batch may exceed what cuBLAS itself reaches on these GPUs (ACHIEVABLE_BF16), else the FLOP count or the
# timing is wrong.
MFU_MARGIN = 0.5
ACHIEVABLE_BF16 = 790e12


def check_block_throughput(rows: dict[int, dict[str, float]]) -> None:
    """rows: batch -> {'tflops', 'mfu', ...} of the 20B block's fwd+bwd (test_dit_cuda.py). Raises AssertionError
    naming the batch and the bound when a figure falls outside the planner's assumption (module comment)."""
    from megatron_omni.planner import DEFAULT_MFU

    for b, r in rows.items():
        assert 0 < r["tflops"] * 1e12 <= ACHIEVABLE_BF16, \
            f"batch {b}: {r['tflops']:.1f} TFLOP/s is outside (0, {ACHIEVABLE_BF16 / 1e12:.0f}]: {rows}"
    floor = (1 - MFU_MARGIN) * DEFAULT_MFU
    assert rows[1]["mfu"] >= floor, \
        f"batch 1: MFU {rows[1]['mfu']:.3f} < {floor:.3f} ({1 - MFU_MARGIN:.0%} of the planner's {DEFAULT_MFU}): {rows}"
