"""`algorithm.name` against what it combines with, and the held-out evaluation's own checks: each refused before
any work with one line naming the field (the value sets and bounds of the new fields are covered by
test_config_validation.py's table-driven cases); each algorithm's OCR miniature recipe is valid."""

from __future__ import annotations

import pytest

from megatron_omni.trainer.config import ConfigError, JobConfig, apply_overrides


@pytest.mark.parametrize(("overrides", "field_name", "words"), [
    (["algorithm.mixgrpo.shift=2"], "algorithm.mixgrpo", "applies to algorithm.name=mixgrpo only"),
    (["algorithm.name=grpo_guard", "algorithm.nft.mix_beta=0.5"], "algorithm.nft", "diffusionnft only"),
    (["rollout.noise_level=0"], "rollout.noise_level", "SDE window"),
    (["algorithm.name=mixgrpo", "rollout.window_size=0"], "rollout.noise_level", "SDE window"),
    (["algorithm.name=grpo_guard", "rollout.sde_type=cps", "rollout.noise_level=0.7"], "rollout.sde_type",
     "use rollout.sde_type=sde"),
    (["algorithm.name=diffusionnft", "algorithm.max_logp_gap=0.1"], "algorithm.max_logp_gap", "no log-probs"),
    (["algorithm.name=diffusionnft", "eval.prompts=[\"a cat\"]", "eval.rollout_sampler=true"],
     "eval.rollout_sampler", "ODE"),
    (["algorithm.name=diffusionnft", "model.lora.rank=4"], "algorithm.nft.decay_cap", "full copy"),
    (["eval.transfer_prompts=[\"a dog\"]"], "eval.transfer_prompts", "needs eval.prompts"),
    (["eval.prompts=[\"a dog\"]", "eval.transfer_prompts=[\"a dog\"]"], "eval.transfer_prompts", "not both"),
    # seed 10's RL seeds start at 10,000,030 and run into the evaluation's 10,010,000 after 9,970 samples
    (["seed=10", "steps=700", "eval.prompts=[\"a dog\"]"], "eval.seeds_per_prompt", "RL steps sample"),
    # the quantized rollout (rollout.quantization) and its importance-weight correction (algorithm.is_cap)
    (["rollout.quantization=fp8", "rollout.transformer=trainer"], "rollout.quantization", "trainer's own module"),
    (["rollout.quantization=fp8", "model.family=wan"], "rollout.quantization", "names no quantized linears"),
    (["rollout.quantization=fp8", "model.lora.rank=4", "rollout.lora_sync=adapter"], "rollout.quantization",
     "rollout.lora_sync=merge"),
    (["rollout.quantization=fp8", "rollout.engine=vllm_omni", "eval.prompts=[\"a dog\"]"], "rollout.quantization",
     "cannot"),
    (["algorithm.is_cap=0.5"], "algorithm.is_cap", "must be >= 1"),
    (["algorithm.name=diffusionnft", "rollout.noise_level=0", "algorithm.is_cap=2"], "algorithm.is_cap",
     "no log-probs"),
    (["algorithm.is_cap=2", "algorithm.old_logprob=bypass"], "algorithm.is_cap", "every weight would be 1"),
    (["algorithm.is_level=sample"], "algorithm.is_level", "needs algorithm.is_cap"),
])
def test_algorithm_combinations_are_refused(overrides: list[str], field_name: str, words: str) -> None:
    cfg = apply_overrides(JobConfig(), overrides)
    with pytest.raises(ConfigError) as info:
        cfg.validate(1)
    message = str(info.value)
    assert message.startswith(field_name) and "\n" not in message and words in message, message


@pytest.mark.parametrize("overrides", [
    ["algorithm.name=mixgrpo", "algorithm.mixgrpo.flash_ratio=0.4", "rollout.window_range=[0, 8]"],
    ["algorithm.name=grpo_guard"],
    # a LoRA run keeps the old policy as the model itself when the schedule stays 0 through the run
    ["algorithm.name=diffusionnft", "model.lora.rank=4", "algorithm.nft.decay_cap=0", "rollout.noise_level=0"],
    ["seed=10", "steps=300", "eval.prompts=[\"a dog\"]", "eval.transfer_prompts=[\"a cat\"]"],
    ["rollout.quantization=fp8", "algorithm.is_cap=2", "algorithm.is_level=geometric", "eval.prompts=[\"a dog\"]"],
    ["rollout.quantization=fp8", "model.lora.rank=4", "algorithm.name=grpo_guard", "algorithm.is_cap=0"],
])
def test_valid_algorithm_settings_pass(overrides: list[str]) -> None:
    apply_overrides(JobConfig(), overrides).validate(1)


@pytest.mark.parametrize("name", ["ocr_miniature", "ocr_miniature_mixgrpo", "ocr_miniature_nft",
                                  "ocr_miniature_grpo_guard"])
def test_ocr_miniature_recipes_are_valid_and_hold_out_fairly(name: str) -> None:
    """Every algorithm's recipe validates; its held-out words are the RL words (new seeds) and unseen words made
    of RL glyphs only, with the pretraining words RL never sees as transfer."""
    from examples.tiny import recipe
    from model_providers.ocr_miniature.text_dataset import (
        HELD_OUT_WORDS,
        RL_WORDS,
        UNSEEN_WORDS,
        VOCABULARY,
        glyphs,
        prompt_for,
    )

    cfg = getattr(recipe, name)()
    cfg.validate(1)
    assert cfg.eval.prompts == [prompt_for(w) for w in RL_WORDS + UNSEEN_WORDS]
    assert cfg.eval.transfer_prompts == [prompt_for(w) for w in HELD_OUT_WORDS]
    assert glyphs(UNSEEN_WORDS) <= glyphs(RL_WORDS) and not set(UNSEEN_WORDS) & set(VOCABULARY)
    assert not glyphs(HELD_OUT_WORDS) <= glyphs(RL_WORDS)  # the digits: transfer, not the held-out figure
