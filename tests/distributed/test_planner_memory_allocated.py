"""The dry-run planner's memory formula against the bytes the code really allocates.

On two gloo ranks, for the tiny and small presets at TP 1 and 2 (dp = 2 / tp), in fp32 and bf16, with and
without the distributed optimizer: each rank builds the Megatron model, wraps it the way the trainer does
(`training_state.build_ddp_and_optimizer`), takes one optimizer step (Adam's state is created lazily) and
counts the storages behind its parameters, DDP's main-grad buffers, the main parameters and Adam's moments
(`allocated_bytes`); the embedded rollout engine's copy is diffusers' transformer in the rollout dtype. The
planner's figures for the same config must be within 5% of each (rank 0, the first stage, is what the
planner reports).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_omni.parallel.layout import ParallelLayout
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.planner import Precision, RolloutSpec, Workload, plan
from model_providers.qwen_image import provider

CASES = list(itertools.product(("tiny", "small"), (1, 2), ("fp32", "bf16"), (False, True)))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _measure(rank: int, world_size: int) -> dict:
    from diffusers import QwenImageTransformer2DModel

    from megatron_omni.parallel import build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.trainer.training_state import OptimizerSettings, allocated_bytes, build_ddp_and_optimizer

    out = {}
    for preset, tp, dtype, distributed in CASES:
        groups = build_parallel_groups(ParallelLayout(tp=tp))
        seed_everything(0, tp_rank=groups.tp.rank())
        cfg = provider.transformer_config(preset, tp=tp, params_dtype=DTYPES[dtype])
        model = provider.build_model(cfg, groups)
        ddp, optimizer = build_ddp_and_optimizer(model, cfg, groups.mcore,
                                                 OptimizerSettings(lr=1e-4, distributed_optimizer=distributed))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ok, _, _ = optimizer.step()
        assert ok
        counted = allocated_bytes(ddp, optimizer)
        engine = QwenImageTransformer2DModel(**provider.hf_config(preset)).to(DTYPES[dtype])
        counted["rollout_weights"] = sum(p.numel() * p.element_size() for p in engine.parameters())
        out[(preset, tp, dtype, distributed)] = counted
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_ranks(_measure, 2, timeout_s=600)[0]


@pytest.mark.parametrize("preset,tp,dtype,distributed", CASES)
def test_planner_memory_equals_allocated_bytes(measured, preset: str, tp: int, dtype: str,
                                               distributed: bool) -> None:
    report = plan(preset, ParallelLayout(tp=tp), 2, "H200", Workload(height=64, width=64, prompts=2, group_size=2),
                  rollout=RolloutSpec(extra_params=0), precision=Precision.of(dtype, dtype, distributed),
                  recompute="none")
    got = measured[(preset, tp, dtype, distributed)]
    m = report.memory
    predicted = {"parameters": m.parameters, "gradients": m.gradients, "optimizer_states": m.optimizer_states,
                 "rollout_weights": m.rollout_weights}
    for part, value in predicted.items():
        assert got[part] > 0, part
        assert abs(value - got[part]) <= 0.05 * got[part], (
            f"{part}: planner {value:,} B vs allocated {got[part]:,} B ({value / got[part]:.3f})")
