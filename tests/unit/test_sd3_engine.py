"""The embedded SD3.5 rollout engine on the offline tiny pipeline: its ODE with true CFG (4.5, plain guidance)
samples what `StableDiffusion3Pipeline` samples for the same seed; its SDE trajectories carry the pooled CLIP
embeddings (the negative prompt's too) and record plain CFG, so the recorded log-probs are recomputed exactly by
the engine's transformer and by our Megatron SD3 model loaded from the engine's weights (behind the trainer's
`DiffusersForward`). One pipeline and one engine serve the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.rollout.base import SamplingParams, Trajectory
from megatron_omni.rollout.diffusers_engines.engine import build_diffusers_engine
from megatron_omni.rollout.diffusers_engines.sd3 import SD3RolloutEngine
from megatron_omni.rollout.registry import EngineSettings
from model_providers import get_family
from model_providers.sd3.tiny_pipeline import make_tiny_pipeline

CFG = dict(height=64, width=64, guidance_scale=4.5, negative_prompt="", max_sequence_length=16)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> SD3RolloutEngine:
    folder = make_tiny_pipeline(tmp_path_factory.mktemp("sd3") / "pipe", seed=0)
    eng = build_diffusers_engine(folder, EngineSettings())
    assert isinstance(eng, SD3RolloutEngine)
    return eng


@pytest.fixture(scope="module")
def groups():
    platform.init_distributed(rank=0, world_size=1)
    yield build_parallel_groups(ParallelLayout())
    platform.destroy_distributed()


@pytest.fixture(scope="module")
def sde_traj(engine: SD3RolloutEngine) -> Trajectory:
    params = SamplingParams(num_steps=4, noise_level=0.7, window_size=2, **CFG)
    return engine.generate(["a red cat", "a blue ball"], params, group_size=2, seeds=[3, 4, 5, 6])


def test_ode_with_cfg_samples_what_the_diffusers_pipeline_samples(engine: SD3RolloutEngine) -> None:
    params = SamplingParams(num_steps=4, noise_level=0.0, **CFG)
    traj = engine.generate(["a red cat"], params, group_size=2, seeds=[7, 8])
    assert traj.log_probs.shape == (2, 0) and traj.cfg_rescale is False
    ref = engine.pipe("a red cat", negative_prompt="", guidance_scale=4.5, height=64, width=64,
                      num_inference_steps=4, max_sequence_length=16, generator=torch.Generator().manual_seed(8),
                      output_type="pt").images
    assert float(ref.std()) > 0
    # The scheduler's t = 1000 sigma vs ours 1000 x model_timesteps(sigma): an fp32 ulp of the timestep.
    diff = float((ref[0] - traj.images[1]).abs().max())
    print(f"sd3 engine ODE vs StableDiffusion3Pipeline: max abs {diff:.3g}")
    assert diff < 1e-4


def test_trajectory_carries_pooled_embeddings_and_plain_cfg(engine: SD3RolloutEngine, sde_traj: Trajectory) -> None:
    t = sde_traj
    p = engine.transformer.config.pooled_projection_dim
    assert t.pooled_embeds.shape == (4, p) and t.negative_pooled_embeds.shape == (4, p)
    assert t.prompt_embeds.shape[1] == 77 + 16 and bool(t.prompt_embeds_mask.all())
    pooled = engine.pipe.encode_prompt("a blue ball", None, None, do_classifier_free_guidance=False,
                                       max_sequence_length=16)[2]
    assert torch.equal(t.pooled_embeds[2], pooled[0].float())
    assert not torch.equal(t.pooled_embeds[0], t.pooled_embeds[2])
    assert torch.equal(t.negative_pooled_embeds[0], t.negative_pooled_embeds[3])
    assert t.cfg_rescale is False and t.latents.shape == (4, 2, 16, 16)  # 4 x 4 tokens of 4 x 2 x 2
    sub = Trajectory.concat([t.select([0, 1]), t.select([2, 3])])
    assert torch.equal(sub.pooled_embeds, t.pooled_embeds) and sub.cfg_rescale is False
    with pytest.raises(ValueError, match="CFG settings"):
        Trajectory.concat([t.select([0]), Trajectory(**{**vars(t.select([1])), "cfg_rescale": True})])


def test_log_probs_recompute_exactly_in_the_engine_and_the_megatron_model(engine: SD3RolloutEngine,
                                                                         sde_traj: Trajectory, groups) -> None:
    again = recompute_log_probs(sde_traj, engine.velocity_model).log_probs
    assert torch.equal(again, sde_traj.log_probs)
    fam = get_family("sd3")
    model = fam.build_model(fam.megatron_config(engine.transformer_config()), groups)
    fam.load_state(model, engine.initial_state_dict())
    with torch.no_grad():
        ours = recompute_log_probs(sde_traj, DiffusersForward(model)).log_probs
    diff = float((ours - sde_traj.log_probs).abs().max())
    print(f"sd3 Megatron recompute vs rollout log-probs: max abs {diff:.3g} (of {float(ours.abs().max()):.3g})")
    assert diff < 1e-5
    # without the pooled embeddings the recompute is refused by name, not run on something else
    with pytest.raises(ValueError, match="pooled"):
        recompute_log_probs(Trajectory(**{**vars(sde_traj), "pooled_embeds": None, "negative_pooled_embeds": None}),
                            DiffusersForward(model))


def test_flash_tail_and_video_are_refused(engine: SD3RolloutEngine) -> None:
    with pytest.raises(ValueError, match="Flash"):
        engine.generate(["x"], SamplingParams(num_steps=4, noise_level=0.7, window_size=1, window_start=0,
                                              tail_steps=2, **CFG))
    with pytest.raises(ValueError, match="num_frames"):
        engine.generate(["x"], SamplingParams(num_steps=4, num_frames=5, **CFG))


def test_pipeline_folder_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        SD3RolloutEngine(tmp_path / "missing")
