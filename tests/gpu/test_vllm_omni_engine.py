"""The full `VllmOmniRolloutEngine` (vLLM-Omni's `Omni` with our pipeline class and worker extension) end to
end against the embedded diffusers engine, on a CUDA device.

Needs a GPU and vLLM + vLLM-Omni built for it; skips with the reason otherwise. On CPU the same pipeline
class and weight receiver are tested without the engine around them (tests/distributed/test_rollout_vllm_omni.py):
`from vllm_omni import Omni` needs torchvision (transformers' Qwen2-VL image processor), which does not
install beside the CPU torch, and vLLM-Omni has no CPU diffusion platform.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_omni.rollout.base import SamplingParams
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline
from tests.gpu.vllm_omni_gpu import require_vllm_omni_gpu

pytestmark = pytest.mark.gpu

PROMPTS = ["a red cat", "OPEN 24 HOURS"]
NON_CFG = SamplingParams(height=64, width=64, num_steps=6, noise_level=1.2, window_size=2, window_range=(0, 4))
CFG = replace(NON_CFG, guidance_scale=4.0, negative_prompt=" ")
# Both engines run fp32, but vLLM-Omni's attention and GEMM kernels are not diffusers' (TF32 is off).
TOL = 2e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    require_vllm_omni_gpu("tests/distributed/test_rollout_vllm_omni.py")
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine

    folder: Path = make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)
    vllm_engine = VllmOmniRolloutEngine(folder, tensor_parallel_size=1, dtype="float32", enable_sleep_mode=True)
    ref = DiffusersRolloutEngine(folder, max_batch_size=4)
    yield vllm_engine, ref
    vllm_engine.close()


def _assert_same(a, b, tol: float = TOL) -> None:
    assert a.prompts == b.prompts and a.img_shape == b.img_shape
    for f in ("window_start", "seeds", "group_ids", "sigmas"):
        assert torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu()), f
    for f in ("images", "latents", "next_latents", "log_probs", "prompt_embeds"):
        x, y = getattr(a, f).float().cpu(), getattr(b, f).float().cpu()
        assert x.shape == y.shape, (f, x.shape, y.shape)
        assert float((x - y).abs().max()) < tol, (f, float((x - y).abs().max()))


@pytest.mark.parametrize("params", [NON_CFG, CFG], ids=["no_cfg", "cfg"])
def test_engine_equals_diffusers_engine(engines, params: SamplingParams) -> None:
    vllm_engine, ref = engines
    seen = []
    traj = vllm_engine.generate(PROMPTS, params, group_size=2, seeds=[3, 4, 5, 6], on_sample=seen.append)
    assert sorted(s.index for s in seen) == [0, 1, 2, 3]
    assert traj.log_probs.shape == (4, 2)
    _assert_same(traj, ref.generate(PROMPTS, params, group_size=2, seeds=[3, 4, 5, 6]))


def test_weight_update_sleep_and_partial_update(engines) -> None:
    vllm_engine, ref = engines
    before = vllm_engine.generate(PROMPTS, NON_CFG, seeds=[7, 8])
    g = torch.Generator().manual_seed(1)
    weights = {k: v.detach().cpu() + 0.05 * torch.randn(v.shape, generator=g)
               for k, v in ref.transformer.state_dict().items()}
    names = vllm_engine.load_weights(weights.items())
    assert sorted(names) == sorted(weights)
    ref.load_weights(weights.items())
    after = vllm_engine.generate(PROMPTS, NON_CFG, seeds=[7, 8])
    assert float((after.images - before.images).abs().max()) > 1e-3
    _assert_same(after, ref.generate(PROMPTS, NON_CFG, seeds=[7, 8]))
    vllm_engine.sleep()
    vllm_engine.wake_up()
    _assert_same(vllm_engine.generate(PROMPTS, NON_CFG, seeds=[7, 8]), after, tol=1e-6)
    with pytest.raises(Exception, match="partial weight update"):
        vllm_engine.load_weights([("proj_out.bias", weights["proj_out.bias"])])


def test_trainer_drives_the_engine_by_configuration(tmp_path) -> None:
    """The trainer's path: `rollout.engine=vllm_omni` builds the engine through the rollout registry (vLLM-Omni's
    `Omni` with our pipeline and extension, sleep mode on), one FlowGRPO step puts it to sleep for the update,
    wakes it, syncs through the bridge (full mode, bucket RPCs) and proves the sync with the probe forward; the
    second step samples the synced weights with the trainer's log-probs agreeing."""
    require_vllm_omni_gpu("tests/distributed/test_trainer_vllm_omni.py")
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
    from megatron_omni.trainer.config import JobConfig
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    folder = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    platform.init_distributed(rank=0, world_size=1)
    cfg = JobConfig(run_dir=str(tmp_path / "run"), steps=2, seed=0)
    cfg.rollout.engine = "vllm_omni"
    cfg.rollout.num_steps = 6
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.optim.mini_batches = 2, 2, 1
    cfg.algorithm.clip_range = 0.2
    cfg.validate(1)
    trainer = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout()), folder,
                              RewardFunction("jpeg_compressibility"))
    try:
        assert type(trainer.engine).__name__ == "VllmOmniRolloutEngine" and trainer.weight_sync.plan.mode == "full"
        for step in range(2):
            m = trainer.train_step(step).metrics
            print(step, {k: m[k] for k in ("reward_mean", "train_rollout_dlogp", "sync_probe_max_diff", "time_sync")})
            assert m["sync_probe_max_diff"] < 1e-4 and m["train_rollout_dlogp"] < 1e-4, m
    finally:
        trainer.close()
        platform.destroy_distributed()
