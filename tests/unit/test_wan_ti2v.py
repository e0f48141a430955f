"""Wan2.2-TI2V-5B's layout on the tiny offline folder in that layout (`make_tiny_ti2v_pipeline`: expand_timesteps,
48 latent channels, Wan2.2's residual VAE with 16x spatial compression): the embedded engine's ODE rollout is
`WanPipeline`'s video (text-to-video, per-token timesteps) and `WanImageToVideoPipeline`'s (the first frame's
latents as the condition) for the same seeds; an image-to-video SDE trajectory keeps the condition tokens clean at
every step, they carry no log-prob (changing their velocity changes nothing), our Megatron model (world size 1)
recomputes the rollout's log-probs to |dlogp| <= 1e-6; the folder's transformer converts byte-exactly; an image
prompt on a text-to-video folder is refused by name; DiffusionNFT's points on an image-to-video trajectory keep the
condition clean and its loss leaves the condition tokens out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from PIL import Image

from megatron_omni.algorithms.transition import recompute_log_probs, transition_inputs, transition_output
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import build_diffusers_engine
from megatron_omni.rollout.diffusers_engines.wan import WanRolloutEngine
from megatron_omni.rollout.registry import EngineSettings
from model_providers.qwen_image_edit.data import EditRecord
from model_providers.wan import provider
from model_providers.wan.tiny_pipeline import make_tiny_ti2v_pipeline
from tests.unit.test_checkpoint_convert import assert_round_trip_byte_exact

# 64 x 64 pixels, 9 frames: a latent video of 3 x 4 x 4 (16x spatial), a patch grid of (3, 2, 2): 12 tokens, the
# first frame's 4 the image condition
SDE = SamplingParams(height=64, width=64, num_frames=9, num_steps=4, noise_level=1.0, window_size=2,
                     window_range=(0, 3), max_sequence_length=16)
TEXT = ["a red cat", "waves"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(make_tiny_ti2v_pipeline(tmp_path_factory.mktemp("wan") / "tiny-ti2v", seed=0))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    """Two image records (a gradient, a checkerboard) as the trainer's prompt strings."""
    root = tmp_path_factory.mktemp("images")
    y, x = torch.meshgrid(torch.arange(48), torch.arange(80), indexing="ij")
    arrays = [torch.stack([x * 3, y * 5, (x + y) * 2], -1), ((x // 8 + y // 8) % 2 * 255)[..., None].repeat(1, 1, 3)]
    out = []
    for i, a in enumerate(arrays):
        path = root / f"im{i}.png"
        Image.fromarray(a.clamp(0, 255).to(torch.uint8).numpy()).save(path)
        out.append(EditRecord(str(path), TEXT[i]).prompt)
    return out


@pytest.fixture(scope="module")
def engine(folder: str) -> WanRolloutEngine:
    engine = build_diffusers_engine(folder, EngineSettings(max_batch_size=4))
    assert isinstance(engine, WanRolloutEngine) and engine.expand_timesteps
    return engine


def _frames(pipe, seeds, **kw) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return pipe(height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=1.0, max_sequence_length=16,
                generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt", **kw).frames


def test_ode_rollouts_are_the_ti2v_pipelines_videos(folder: str, engine: WanRolloutEngine, images,
                                                    monkeypatch) -> None:
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    # diffusers 0.40's image-to-video pipeline calls ftfy unguarded (not installed); WanPipeline's cleaning (what
    # the engine applies) skips it when ftfy is absent: the same text here
    monkeypatch.setattr(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)
    ode = replace(SDE.ode(), num_frames=5)  # 2 latent frames: 8 tokens, the first 4 the condition
    t2v = engine.generate(TEXT[1:], ode, seeds=[4])
    want = _frames(WanPipeline.from_pretrained(folder, local_files_only=True), [4], prompt=TEXT[1:])
    assert t2v.images.shape == want.shape == (1, 5, 3, 64, 64) and t2v.clean_tokens == 0
    assert float((t2v.images - want).abs().max()) < 1e-5
    i2v = engine.generate(images[1:], ode, seeds=[4])
    pipe = WanImageToVideoPipeline.from_pretrained(folder, local_files_only=True, image_encoder=None,
                                                   image_processor=None)
    want = _frames(pipe, [4], prompt=TEXT[1], image=EditRecord.parse(images[1]).load_image())
    assert i2v.img_shape == (2, 2, 2) and i2v.clean_tokens == 4
    assert float((i2v.images - want).abs().max()) < 1e-5
    assert float((i2v.images - t2v.images).abs().max()) > 1e-2  # the image conditions the video


def test_image_to_video_trajectory_keeps_the_condition_and_recomputes(engine: WanRolloutEngine, images, groups) -> None:
    traj = engine.generate(images, SDE, group_size=2, seeds=[11, 12, 13, 14])
    k = traj.clean_tokens
    cond = traj.final_latents[:, :k]
    assert k == 4 and traj.log_probs.shape == (4, 2)
    for lat in (traj.latents, traj.next_latents):
        assert torch.equal(lat[:, :, :k], cond[:, None].expand(-1, 2, -1, -1))
    assert torch.equal(cond[0], cond[1]) and not torch.equal(cond[0], cond[2])  # per image
    # the condition tokens carry no log-prob: their velocity does not move it
    rows = torch.arange(4)
    inputs = transition_inputs(traj, rows, 0)
    v = torch.randn(4, 12, traj.latents.shape[-1])
    lp = transition_output(traj, inputs, v).log_prob
    v[:, :k] += 100.0
    assert torch.equal(transition_output(traj, inputs, v).log_prob, lp)
    # our model recomputes the rollout's log-probs (per-token timesteps, the condition at t = 0)
    seed_everything(0)
    model = provider.build_model(provider.transformer_config(engine.transformer_config()), groups)
    provider.load_hf_state_dict(model, engine.transformer.state_dict())
    model.eval()
    with torch.no_grad():
        dlogp = (recompute_log_probs(traj, DiffusersForward(model)).log_probs - traj.log_probs).abs().max()
        print(f"TI2V image-to-video recompute: max |dlogp| {float(dlogp):.2e}")
        assert float(dlogp) <= 1e-6
        # without the clean timesteps the model sees another input: the recompute must differ
        traj.clean_tokens = 0
        off = recompute_log_probs(traj, DiffusersForward(model)).log_probs
        traj.clean_tokens = k
    assert float((off - traj.log_probs).abs().max()) > 1e-4
    _diffusionnft_leaves_the_condition_out(traj)


def _diffusionnft_leaves_the_condition_out(traj) -> None:
    """DiffusionNFT on an image-to-video trajectory: the condition tokens enter clean (not noised, timestep 0) and
    are no part of the loss (their current, old or reference velocity does not move it; the generated tokens' do)."""
    from megatron_omni.trainer.objectives import NftObjective, NftPoints, nft_inputs
    from megatron_omni.trainer.pipeline_step import MicroBatch

    k, n = traj.clean_tokens, traj.seeds.numel()
    points = NftPoints.draw(traj, 2)
    mb = MicroBatch(rows=torch.arange(n), js=torch.tensor([0, 1, 0, 1]))
    inputs = nft_inputs(traj, points, mb)
    assert torch.equal(inputs.xt[:, :k], inputs.x0[:, :k]) and not torch.equal(inputs.xt[:, k:], inputs.x0[:, k:])
    timestep = inputs.batch.model_inputs(torch.float32)["timestep"]
    assert timestep.shape == (n, 12) and (timestep[:, :k] == 0).all() and (timestep[:, k:] > 0).all()
    g = torch.Generator().manual_seed(0)
    old, ref = (torch.randn(n, 2, 12, traj.latents.shape[-1], generator=g) for _ in range(2))
    objective = NftObjective(traj, points, reward_weight=torch.rand(n, generator=g), old_velocity=old, mix_beta=1.0,
                             adv_clip=5.0, weight_min=1e-5, kl_beta=0.1, ref_velocity=ref)
    v = torch.randn(n, 12, traj.latents.shape[-1], generator=g)
    loss = objective.loss(mb, inputs, v)[0]
    moved = v.clone()
    moved[:, :k] += 100.0
    old[..., :k, :] += 100.0
    ref[..., :k, :] -= 100.0
    assert torch.equal(objective.loss(mb, inputs, moved)[0], loss)
    moved[:, k:] += 0.1
    assert not torch.allclose(objective.loss(mb, inputs, moved)[0], loss)


def test_ti2v_transformer_converts_byte_exactly(folder: str, tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    src = tmp_path / "hf"  # the folder's transformer, sharded (the converter's sharded path)
    WanTransformer3DModel.from_pretrained(Path(folder) / "transformer").save_pretrained(src, max_shard_size="100KB")
    assert_round_trip_byte_exact(src, tmp_path, "wan", "WanTransformer3DModel", provider.hf_config)


def test_image_prompt_on_a_text_to_video_folder_is_refused(engine: WanRolloutEngine, images) -> None:
    engine.expand_timesteps = False
    try:
        with pytest.raises(ValueError, match="needs a Wan2.2-TI2V folder"):
            engine.generate(images, SDE.ode())
    finally:
        engine.expand_timesteps = True
    with pytest.raises(ValueError, match="mix image-conditioned and unconditioned"):
        engine.generate([images[0], TEXT[0]], SDE.ode())


def test_the_vllm_omni_wan_pipeline_takes_the_ti2v_layout(folder: str, tmp_path: Path) -> None:
    """The vLLM-Omni Wan pipeline samples TI2V folders (tests/distributed/test_wan_vllm_omni.py compares it): this
    tiny folder is refused only for its head dim 16 (vLLM-Omni's RoPE split), a two-expert folder by name."""
    import shutil

    from megatron_omni.rollout.vllm_omni.wan_pipeline import check_folder, require_one_expert

    with pytest.raises(ValueError, match="attention_head_dim=16"):
        check_folder(folder)
    require_one_expert(folder)
    two = tmp_path / "a14b"
    shutil.copytree(folder, two)
    shutil.copytree(two / "transformer", two / "transformer_2")
    with pytest.raises(ValueError, match="two-expert"):
        require_one_expert(str(two))
