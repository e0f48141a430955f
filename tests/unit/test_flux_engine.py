"""The embedded FLUX.1 rollout engine on the offline tiny pipeline: its ODE with the distilled guidance input samples
what `FluxPipeline` samples for the same seed; its SDE trajectories carry the pooled CLIP embeddings and the guidance
scale, so the recorded log-probs are recomputed exactly by the engine's transformer and by our Megatron FLUX model
loaded from the engine's weights (behind the trainer's `DiffusersForward`); the guidance input changes the velocity
and a trajectory without it is refused. One pipeline and one engine serve the module."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.rollout.base import SamplingParams, Trajectory
from megatron_omni.rollout.diffusers_engines.engine import build_diffusers_engine
from megatron_omni.rollout.diffusers_engines.flux import FluxRolloutEngine
from megatron_omni.rollout.registry import EngineSettings
from model_providers import get_family
from model_providers.flux.tiny_pipeline import make_tiny_pipeline

SIZE = dict(height=64, width=64, max_sequence_length=16)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> FluxRolloutEngine:
    folder = make_tiny_pipeline(tmp_path_factory.mktemp("flux") / "pipe", seed=0)
    eng = build_diffusers_engine(folder, EngineSettings())
    assert isinstance(eng, FluxRolloutEngine)
    return eng


@pytest.fixture(scope="module")
def sde_traj(engine: FluxRolloutEngine) -> Trajectory:
    params = SamplingParams(num_steps=4, noise_level=0.7, window_size=2, distilled_guidance=4.0, **SIZE)
    return engine.generate(["a red cat", "a blue ball"], params, group_size=2, seeds=[3, 4, 5, 6])


def test_ode_samples_what_the_diffusers_pipeline_samples(engine: FluxRolloutEngine) -> None:
    params = SamplingParams(num_steps=4, noise_level=0.0, **SIZE)
    traj = engine.generate(["a red cat"], params, group_size=2, seeds=[7, 8])
    assert traj.log_probs.shape == (2, 0) and traj.distilled_guidance.tolist() == [3.5, 3.5]
    ref = engine.pipe("a red cat", guidance_scale=3.5, height=64, width=64, num_inference_steps=4,
                      max_sequence_length=16, generator=torch.Generator().manual_seed(8), output_type="pt").images
    assert float(ref.std()) > 0
    diff = float((ref[0] - traj.images[1]).abs().max())
    print(f"flux engine ODE vs FluxPipeline: max abs {diff:.3g}")
    assert diff < 1e-4


def test_trajectory_carries_pooled_embeddings_and_guidance(engine: FluxRolloutEngine, sde_traj: Trajectory) -> None:
    t = sde_traj
    assert t.pooled_embeds.shape == (4, engine.transformer.config.pooled_projection_dim)
    assert t.negative_pooled_embeds is None and t.negative_prompt_embeds is None
    assert t.prompt_embeds.shape[1] == 16 and bool(t.prompt_embeds_mask.all())
    embeds, pooled, _ = engine.pipe.encode_prompt("a blue ball", None, max_sequence_length=16)
    assert torch.equal(t.pooled_embeds[2], pooled[0].float()) and torch.equal(t.prompt_embeds[2], embeds[0].float())
    assert t.distilled_guidance.tolist() == [4.0] * 4 and t.latents.shape == (4, 2, 16, 64)  # 4 x 4 packed patches
    sub = Trajectory.concat([t.select([0, 1]), t.select([2, 3])])
    assert torch.equal(sub.distilled_guidance, t.distilled_guidance)


def test_log_probs_recompute_exactly_in_the_engine_and_the_megatron_model(engine: FluxRolloutEngine,
                                                                         sde_traj: Trajectory, groups) -> None:
    again = recompute_log_probs(sde_traj, engine.velocity_model).log_probs
    assert torch.equal(again, sde_traj.log_probs)
    fam = get_family("flux")
    model = fam.build_model(fam.megatron_config(engine.transformer_config()), groups)
    fam.load_state(model, engine.initial_state_dict())
    with torch.no_grad():
        ours = recompute_log_probs(sde_traj, DiffusersForward(model)).log_probs
        other = recompute_log_probs(Trajectory(**{**vars(sde_traj), "distilled_guidance": sde_traj.distilled_guidance
                                                  * 0 + 1.0}), DiffusersForward(model)).log_probs
    diff = float((ours - sde_traj.log_probs).abs().max())
    print(f"flux Megatron recompute vs rollout log-probs: max abs {diff:.3g} (of {float(ours.abs().max()):.3g})")
    assert diff < 1e-5
    assert float((other - ours).abs().max()) > 1e-3  # the guidance input matters: it is not silently dropped
    for missing in ("distilled_guidance", "pooled_embeds"):
        with pytest.raises(ValueError, match="guidance" if missing == "distilled_guidance" else "pooled"):
            recompute_log_probs(Trajectory(**{**vars(sde_traj), missing: None}), DiffusersForward(model))


def test_true_cfg_flash_tail_and_a_guidance_setting_without_guidance_embeds(engine: FluxRolloutEngine) -> None:
    with pytest.raises(ValueError, match="Flash"):
        engine.generate(["x"], SamplingParams(num_steps=4, noise_level=0.7, window_size=1, window_start=0,
                                              tail_steps=2, **SIZE))
    with pytest.raises(ValueError, match="distilled_guidance must be positive"):
        SamplingParams(distilled_guidance=0.0)
    engine.transformer.config.guidance_embeds = False  # FLUX.1-schnell's shape: no guidance input
    try:
        with pytest.raises(ValueError, match="no guidance embedding"):
            engine.generate(["x"], SamplingParams(num_steps=2, distilled_guidance=3.5, **SIZE))
    finally:
        engine.transformer.config.guidance_embeds = True
