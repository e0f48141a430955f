"""The embedded Wan rollout engine on the tiny offline Wan pipeline: its ODE rollout is `WanPipeline`'s video
for the same seeds (with and without true CFG), one guided rollout step is `WanPipeline`'s guided velocity, its
SDE rollout records a video `Trajectory` whose log-probs the transition code recomputes, a sample does not depend
on what it was batched with, our Megatron model (world size 1) recomputes the rollout's log-probs (with and
without CFG) to |dlogp| <= 1e-6, the sigma grid is the scheduler's, the pipeline folder is a function of its
seed, and what the engine does not do is refused by name."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from megatron_omni.algorithms.schedule import static_shift_of, static_shift_sigmas
from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.algorithms.velocity import guided_batch
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.models.dit.embeddings import patchify_video
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import build_diffusers_engine
from megatron_omni.rollout.diffusers_engines.wan import WanRolloutEngine
from megatron_omni.rollout.registry import EngineSettings
from model_providers.wan import provider
from model_providers.wan.tiny_pipeline import make_tiny_pipeline

PROMPTS = ["a red cat", 'a sign that says "OPEN 24"']
# 32 x 32 pixels, 5 frames: a latent video of 2 x 4 x 4, a patch grid of (2, 2, 2)
SDE = SamplingParams(height=32, width=32, num_frames=5, num_steps=4, noise_level=1.0, window_size=2,
                     window_range=(0, 3), max_sequence_length=16)
NEG = "blurred, static"
CFG = dict(guidance_scale=5.0, negative_prompt=NEG)  # WanPipeline's default scale


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(make_tiny_pipeline(tmp_path_factory.mktemp("wan") / "tiny-wan", seed=0))


@pytest.fixture(scope="module")
def engine(folder: str) -> WanRolloutEngine:
    engine = build_diffusers_engine(folder, EngineSettings(max_batch_size=4))
    assert isinstance(engine, WanRolloutEngine)
    return engine


def test_ode_rollout_is_wan_pipelines_video(folder: str, engine: WanRolloutEngine) -> None:
    params = SDE.ode()
    traj = engine.generate(PROMPTS, params, seeds=[3, 4])
    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=PROMPTS, height=32, width=32, num_frames=5, num_inference_steps=4, guidance_scale=1.0,
                max_sequence_length=16, generator=[torch.Generator().manual_seed(s) for s in (3, 4)],
                output_type="pt").frames
    assert traj.images.shape == want.shape == (2, 5, 3, 32, 32)
    assert float((traj.images - want).abs().max()) < 1e-5
    assert traj.img_shape == (2, 2, 2) and traj.log_probs.shape == (2, 0)
    # the text is zero-padded to max_sequence_length, as the pipeline pads it
    assert traj.prompt_embeds.shape[1] == 16 and not traj.prompt_embeds[0, traj.prompt_embeds_mask[0].sum():].any()


def _pipeline_first_step(folder: str, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """WanPipeline with true CFG (5.0, NEG) over PROMPTS: its initial noise, the latents after its first Euler step,
    and its frames [2, 5, 3, 32, 32] (4 steps)."""
    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    seen: list[torch.Tensor] = []

    def first_step(p, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        return {}

    frames = pipe(prompt=PROMPTS, negative_prompt=NEG, height=32, width=32, num_frames=5, num_inference_steps=4,
                  guidance_scale=5.0, max_sequence_length=16,
                  generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt",
                  callback_on_step_end=first_step).frames
    noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(seeds[0]))
    noise = torch.cat([noise, torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(seeds[1]))])
    return noise, seen[0], frames


def test_true_cfg_is_wan_pipelines_guidance(folder: str, engine: WanRolloutEngine) -> None:
    noise, after, frames = _pipeline_first_step(folder, [3, 4])
    # The ODE rollout with CFG 5.0 is the pipeline's video for the same seeds.
    ode = engine.generate(PROMPTS, replace(SDE.ode(), **CFG), seeds=[3, 4])
    assert ode.cfg_rescale is False and torch.equal(ode.guidance_scale, torch.full((2,), 5.0))
    assert float((ode.images - frames).abs().max()) < 1e-5
    # One guided step: the SDE rollout's window starts at step 0; its recorded x_0 is the pipeline's noise and the
    # guided velocity the recompute builds from the trajectory (prompt and negative rows) is the pipeline's.
    traj = engine.generate(PROMPTS, replace(SDE, window_range=(0, 2), **CFG), seeds=[3, 4])
    x0 = traj.latents[:, 0]
    assert torch.equal(x0, patchify_video(noise, engine.patch_size))
    s0, s1 = traj.sigmas[0, 0], traj.sigmas[0, 1]
    want = patchify_video((after - noise) / (s1 - s0), engine.patch_size)
    neg_len = traj.negative_prompt_embeds_mask.sum(1)
    assert traj.negative_prompt_embeds.shape[1] == 16 and not traj.negative_prompt_embeds[0, neg_len[0]:].any()
    with torch.no_grad():
        got = guided_batch(x0, traj.sigmas[:, 0], traj.prompt_embeds, traj.prompt_embeds_mask, traj.img_shape,
                           guidance_scale=traj.guidance_scale, negative_embeds=traj.negative_prompt_embeds,
                           negative_mask=traj.negative_prompt_embeds_mask,
                           cfg_rescale=traj.cfg_rescale).velocity(engine.velocity_model)
        # rescaled (Qwen-Image's CFG) it would not be the pipeline's
        rescaled = guided_batch(x0, traj.sigmas[:, 0], traj.prompt_embeds, traj.prompt_embeds_mask, traj.img_shape,
                                guidance_scale=traj.guidance_scale, negative_embeds=traj.negative_prompt_embeds,
                                negative_mask=traj.negative_prompt_embeds_mask).velocity(engine.velocity_model)
    err = float((got - want).abs().max())
    print(f"wan guided velocity vs WanPipeline (step 0): max |diff| {err:.2e} of max |v| {float(want.abs().max()):.2f}")
    assert err < 1e-4, err
    assert float((rescaled - want).abs().max()) > 1e-2
    rec = recompute_log_probs(traj, engine.velocity_model)
    assert float((rec.log_probs - traj.log_probs).abs().max()) < 1e-6


def test_sde_rollout_records_video_transitions(folder: str, engine: WanRolloutEngine) -> None:
    traj = engine.generate(PROMPTS, SDE, group_size=2, seeds=[5, 6, 7, 8])
    assert traj.latents.shape == traj.next_latents.shape == (4, 2, 8, 16)  # N, W, 2*2*2 tokens, 4 x (1, 2, 2)
    assert traj.images.shape == (4, 5, 3, 32, 32) and traj.log_probs.shape == (4, 2)
    assert torch.equal(traj.sigmas[0], static_shift_sigmas(4, 3.0))
    rec = recompute_log_probs(traj, engine.velocity_model)
    assert float((rec.log_probs - traj.log_probs).abs().max()) < 1e-6
    # one at a time: the same samples
    solo = WanRolloutEngine(folder, max_batch_size=1)
    again = solo.generate(PROMPTS, SDE, group_size=2, seeds=[5, 6, 7, 8])
    assert float((again.next_latents - traj.next_latents).abs().max()) < 1e-5
    assert solo.stats["forwards"] == 4 * SDE.num_steps  # one sample per forward, where the batched engine ran 4


@pytest.fixture(scope="module")
def one_rank():
    platform.init_distributed(rank=0, world_size=1)
    yield build_parallel_groups(ParallelLayout())
    platform.destroy_distributed()


def test_megatron_recomputes_the_rollouts_log_probs(engine: WanRolloutEngine, one_rank) -> None:
    traj = engine.generate(PROMPTS, replace(SDE, num_frames=9), group_size=2, seeds=[1, 2, 3, 4])
    guided = engine.generate(PROMPTS, replace(SDE, num_frames=9, **CFG), seeds=[5, 6])  # true CFG
    seed_everything(0)
    model = provider.build_model(provider.transformer_config(engine.transformer_config()), one_rank)
    provider.load_hf_state_dict(model, engine.transformer.state_dict())
    with torch.no_grad():
        rec = recompute_log_probs(traj, DiffusersForward(model))
        dlogp = (rec.log_probs - traj.log_probs).abs()
        assert float(dlogp.max()) <= 1e-6, dlogp
        dlogp = (recompute_log_probs(guided, DiffusersForward(model)).log_probs - guided.log_probs).abs()
        assert float(dlogp.max()) <= 1e-6, dlogp
        model.proj_out.weight.mul_(1.1)  # a slightly different model shows up
        changed = recompute_log_probs(traj, DiffusersForward(model)).log_probs
        assert float((changed - traj.log_probs).abs().mean()) > 1e-4


def test_grid_is_the_schedulers() -> None:
    for shift in (1.0, 3.0, 5.0):
        for steps in (1, 4, 10, 50):
            s = FlowMatchEulerDiscreteScheduler(shift=shift)
            s.set_timesteps(steps)
            assert torch.equal(static_shift_sigmas(steps, shift), s.sigmas)
    assert static_shift_of({"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": True, "flow_shift": 5.0}) == 5
    with pytest.raises(ValueError, match="no static flow shift"):
        static_shift_of({"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True})


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_tiny_pipeline_is_a_function_of_its_seed(folder: str, tmp_path: Path) -> None:
    assert _hashes(make_tiny_pipeline(tmp_path / "again", seed=0)) == _hashes(Path(folder))
    assert _hashes(make_tiny_pipeline(tmp_path / "other", seed=1)) != _hashes(Path(folder))


def test_what_the_engine_does_not_do_is_refused(engine: WanRolloutEngine) -> None:
    with pytest.raises(ValueError, match="num_frames - 1 must be a multiple of 4"):
        engine.generate(PROMPTS, replace(SDE, num_frames=6))
    with pytest.raises(ValueError, match="multiples of 16x16"):
        engine.generate(PROMPTS, replace(SDE, height=40))
