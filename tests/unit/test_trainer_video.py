"""The trainer's video pieces without a run: family traits as data (what the trainer and the checks read instead
of a family's name), refusals by traits (field, value, family), the pipeline folder's family, a video sample
reaching the scorer as a frame strip (in process: the same strip the reward server gets), and the run folder's
first-frame PNG grid with the GIF / MP4 beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_omni.rollout.base import FinishedSample
from megatron_omni.trainer.config import ConfigError, JobConfig, apply_overrides
from megatron_omni.trainer.config_checks import check_files
from megatron_omni.trainer.metrics import save_samples
from megatron_omni.trainer.rewards import RewardFunction
from model_providers import get_family
from model_providers.wan.provider import hf_config


def test_families_declare_their_traits() -> None:
    wan, qwen = get_family("wan").traits, get_family("qwen_image").traits
    assert wan.video and wan.frame_multiple == 4 and wan.pipeline_class == "WanPipeline"
    assert wan.rollout_engines == ("diffusers", "vllm_omni") and wan.true_cfg and not wan.flash_tail
    assert not qwen.video and qwen.true_cfg and qwen.flash_tail and "vllm_omni" in qwen.rollout_engines
    tiny = hf_config("tiny")
    assert wan.token_channels(tiny) == tiny["in_channels"] * 4  # packed 3D patch (1, 2, 2)
    assert int(tiny[wan.text_dim_key]) == tiny["text_dim"]
    assert get_family("ar_dit").traits is None  # not trained by the DiT trainer


def _wan(*overrides: str) -> JobConfig:
    return apply_overrides(JobConfig(), ["model.family=wan", "rollout.num_frames=9", *overrides])


def _flux(*overrides: str) -> JobConfig:  # a family without true CFG (traits.true_cfg False)
    return apply_overrides(JobConfig(), ["model.family=flux", *overrides])


@pytest.mark.parametrize("cfg,message", [
    (lambda: _flux("rollout.guidance_scale=2", "rollout.negative_prompt= "),
     "rollout.guidance_scale=2.0 is not supported with model.family=flux"),
    (lambda: _flux("eval.prompts=[\"a cat\"]", "eval.guidance_scale=2"),
     "eval.guidance_scale=2.0 is not supported with model.family=flux"),
    (lambda: _wan("rollout.num_frames=10"), "rollout.num_frames=10 with model.family=wan: num_frames - 1"),
    (lambda: apply_overrides(JobConfig(), ["rollout.num_frames=5"]), "rollout.num_frames=5 with model.family="
                                                                      "qwen_image"),
    (lambda: apply_overrides(JobConfig(), ["reward.scorer=jpeg_compressibility+temporal_consistency"]),
     "reward.scorer='jpeg_compressibility+temporal_consistency' with model.family=qwen_image: temporal_consistency "
     "scores video frame strips"),
])
def test_refusals_by_traits(cfg, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg().validate(1)
    assert str(info.value).startswith(message), str(info.value)


def test_wan_config_with_video_keys_validates() -> None:
    _wan("rollout.max_sequence_length=16", "reward.scorer=temporal_consistency", "reward.video_frames=5",
         "logging.video_format=mp4", "rollout.height=32", "rollout.width=32").validate(1)
    _wan("rollout.guidance_scale=5", "rollout.negative_prompt=", "eval.prompts=[\"a cat\"]",
         "eval.guidance_scale=5").validate(1)  # true CFG (WanPipeline's default 5.0)
    apply_overrides(JobConfig(), ["model.family=qwen_image_edit", "rollout.guidance_scale=4",
                                  "rollout.negative_prompt= ", "eval.prompts=[\"a cat\"]",
                                  "eval.guidance_scale=4"]).validate(1)  # QwenImageEditPlusPipeline's true_cfg_scale


def test_pipeline_folder_of_another_family_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    cfg = apply_overrides(JobConfig(), [f"model.pipeline={folder}", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="holds a WanPipeline and model.family=qwen_image trains a QwenImagePipeline"):
        check_files(cfg)
    assert not (tmp_path / "run").exists()
    cfg.model.family = "wan"
    check_files(cfg)  # the right family: accepted


def _sample(video: torch.Tensor, index: int = 0) -> FinishedSample:
    return FinishedSample(index=index, prompt="a cat", group_id=0, seed=index, image=video)


def test_a_video_reaches_the_scorer_as_a_frame_strip() -> None:
    still = torch.full((9, 3, 16, 24), 0.5)
    flicker = still.clone()
    flicker[1::2] = 1.0
    fn = RewardFunction("temporal_consistency", video_frames=5)
    strip, meta = fn.scored_image(flicker)
    assert strip.shape == (16, 5 * 24, 3) and strip.dtype.name == "uint8" and meta == {"frames": 5}
    fn.begin(2)
    fn.on_sample(_sample(still, 0))
    fn.on_sample(_sample(flicker, 1))
    rewards = fn.collect()
    # 5 of 9 frames are 0, 2, 4, 6, 8: the flicker at the odd frames falls between them
    assert rewards.tolist() == [1.0, 1.0]
    fn9 = RewardFunction("temporal_consistency", video_frames=9)
    fn9.begin(1)
    fn9.on_sample(_sample(flicker))
    assert float(fn9.collect()[0]) == pytest.approx(1 - (255 - 128) / 255, abs=1e-6)  # every frame jumps
    with pytest.raises(ValueError, match="neither an image"):
        RewardFunction("temporal_consistency").scored_image(still)  # a video without video_frames


def test_run_folder_gets_a_first_frame_grid_and_the_video(tmp_path: Path) -> None:
    videos = torch.rand(3, 5, 3, 16, 16)
    caps = [f"p{i}\nr=0.5" for i in range(3)]
    written = save_samples(videos, caps, tmp_path / "step_0001.png", "gif")
    assert written == [tmp_path / "step_0001.png", tmp_path / "step_0001.gif"]
    from PIL import Image

    with Image.open(tmp_path / "step_0001.gif") as gif:
        assert gif.n_frames == 5
    assert save_samples(videos, caps, tmp_path / "step_0002.png", "mp4")[1].read_bytes()[4:8] == b"ftyp"
    assert save_samples(videos[:, 0], caps, tmp_path / "step_0003.png") == [tmp_path / "step_0003.png"]  # images
    assert not (tmp_path / "step_0003.gif").exists()


def test_an_engine_the_family_does_not_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every DiT family lists both engines now (SD3.5 and FLUX.1 gained vLLM-Omni): the refusal is checked on SD3.5
    with its traits narrowed to the embedded engine, and SD3.5 with vLLM-Omni is accepted as it is."""
    import dataclasses

    import model_providers.sd3.family as sd3

    cfg = apply_overrides(JobConfig(), ["model.family=sd3", "rollout.engine=vllm_omni"])
    cfg.validate(1)
    narrowed = dataclasses.replace(sd3.FAMILY.traits, rollout_engines=("diffusers",))
    monkeypatch.setattr(sd3, "FAMILY", dataclasses.replace(sd3.FAMILY, traits=narrowed))
    with pytest.raises(ConfigError, match="rollout.engine='vllm_omni' is not supported with model.family=sd3"):
        cfg.validate(1)
