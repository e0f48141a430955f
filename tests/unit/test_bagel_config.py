"""`model.family=bagel` through the one trainer's config checks: the family is registered as data (kind "mot", its
trainer module named), the tiny recipe validates, and what the BAGEL trainer does not support is refused naming
the setting."""

from __future__ import annotations

import pytest

from examples.bagel.recipe import bagel_7b_h200, tiny
from megatron_omni.trainer.config import ConfigError
from model_providers import get_family


def test_family_names_its_trainer() -> None:
    family = get_family("bagel")
    assert family.kind == "mot" and family.trainer == "megatron_omni.trainer.bagel"
    assert family.presets == ("7b-mot", "tiny") and family.traits is None


def test_tiny_recipe_validates() -> None:
    cfg = tiny()
    cfg.validate(world_size=1)
    assert cfg.model.family == "bagel" and cfg.rollout.engine == "vllm_omni"


@pytest.mark.parametrize("field, value, named", [
    ("rollout.engine", "diffusers", "rollout.engine"),
    ("parallel.pp", 3, "parallel.pp: must divide BAGEL's 2 layers"),
    ("model.lora.adaln", True, "model.lora.adaln"),
    ("algorithm.mixgrpo.flash_ratio", 0.4, "algorithm.mixgrpo.flash_ratio: must be unset"),
    ("algorithm.max_logp_gap", -1.0, "algorithm.max_logp_gap"),
    ("rollout.height", 40, "rollout.height"),
    ("model.preset", "huge", "model.preset"),
    ("prompts", ["a red caf\u00e9"], "does not encode it exactly"),  # outside the tiny tokenizer's ASCII
    ("prompts", ["7 300"], r"token ids must be in \[0, 128\)"),
    ("rollout.window_size", 9, "window"),
    ("eval.prompts", ["7 300"], r"token ids must be in \[0, 128\)"),  # held-out prompts encode like RL prompts
    ("rollout.image_guidance_scale", 0.5, "rollout.image_guidance_scale"),
    ("rollout.vae_dtype", "fp32", "rollout.vae_dtype: must be auto"),
    ("rollout.guidance_scale_2", 2.0, "rollout.guidance_scale_2: must be unset"),
    ("rollout.tp", 2, "rollout.tp: must be 1 or parallel.tp at pp 1"),
])
def test_unsupported_settings_refused_by_name(field: str, value, named: str) -> None:
    cfg = tiny()
    *path, last = field.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)
    with pytest.raises(ConfigError, match=named):
        cfg.validate(world_size=3 if field == "parallel.pp" else 1)


@pytest.mark.parametrize("name", ["grpo_guard", "diffusionnft"])
def test_grpo_guard_and_nft_validate_at_pp2(name: str) -> None:
    cfg = tiny()
    cfg.algorithm.name, cfg.parallel.pp = name, 2
    cfg.validate(world_size=2)


def test_mixgrpo_validates_at_pp2_and_the_shared_algorithm_checks_apply() -> None:
    """MixGRPO's update is FlowGRPO's (pp 2 too); the DiT families' algorithm checks hold for BAGEL: another rule's
    section left at its defaults, an SDE window for the policy-gradient rules, DiffusionNFT's lagging old policy
    not with LoRA."""
    cfg = tiny()
    cfg.algorithm.name, cfg.parallel.pp = "mixgrpo", 2
    cfg.validate(world_size=2)
    cfg.rollout.noise_level = 0.0
    with pytest.raises(ConfigError, match="rollout.noise_level=0.0 with algorithm.name=mixgrpo"):
        cfg.validate(world_size=2)
    cfg = tiny()
    cfg.algorithm.nft.mix_beta = 0.5
    with pytest.raises(ConfigError, match="applies to algorithm.name=diffusionnft only"):
        cfg.validate(world_size=1)
    cfg.algorithm.name, cfg.model.lora.rank = "diffusionnft", 4
    with pytest.raises(ConfigError, match="algorithm.nft.decay_cap"):
        cfg.validate(world_size=1)


def test_both_experts_validate_at_pp1_without_lora() -> None:
    """`model.bagel_experts=both` at tp/cp layouts of pp 1; refused with LoRA (the adapters are the generation
    expert's) and at pp > 1 (the pipelined prompt pass has no autograd), by name."""
    cfg = tiny()
    cfg.model.bagel_experts = "both"
    cfg.validate(world_size=1)
    cfg.model.lora.rank = 4
    with pytest.raises(ConfigError, match="model.bagel_experts: must be generation with LoRA"):
        cfg.validate(world_size=1)
    cfg.model.lora.rank, cfg.parallel.pp = 0, 2
    with pytest.raises(ConfigError, match="model.bagel_experts: must be generation at pp > 1"):
        cfg.validate(world_size=2)
    cfg.model.bagel_experts = "all"
    with pytest.raises(ConfigError, match=r"model\.bagel_experts='all' must be generation\|both"):
        cfg.validate(world_size=2)


def test_lora_kl_ema_settings() -> None:
    """LoRA, the KL term and the EMA validate, at pp 1 and pp 2; LoRA adapts generation-expert linears only, takes
    merged weights and no EMA."""
    cfg = tiny()
    cfg.model.lora.rank, cfg.algorithm.beta = 4, 0.01
    cfg.validate(world_size=1)
    cfg.model.lora.targets = ["decoder.layers.*.mlp.linear_fc1"]  # the understanding expert's
    with pytest.raises(ConfigError, match="not generation-expert linears"):
        cfg.validate(world_size=1)
    cfg.model.lora.targets = ["*.linear_qkv_gn"]
    with pytest.raises(ConfigError, match="match no parallel linear"):
        cfg.validate(world_size=1)
    cfg.model.lora.targets, cfg.rollout.lora_sync = None, "adapter"
    with pytest.raises(ConfigError, match="rollout.lora_sync"):
        cfg.validate(world_size=1)
    cfg.rollout.lora_sync, cfg.optim.ema_decay = "auto", 0.9
    with pytest.raises(ConfigError, match="optim.ema_decay"):
        cfg.validate(world_size=1)
    cfg.model.lora.rank = 0
    cfg.validate(world_size=1)
    cfg.parallel.pp = 2  # pipelined: the KL term and the EMA as at pp 1; LoRA too, still without the EMA
    cfg.validate(world_size=2)
    cfg.model.lora.rank, cfg.optim.ema_decay = 4, 0.0
    cfg.validate(world_size=2)
    cfg.optim.ema_decay = 0.9
    with pytest.raises(ConfigError, match="optim.ema_decay"):
        cfg.validate(world_size=2)


def test_text_prompts_through_the_folders_tokenizer(tmp_path) -> None:
    """The tiny folder carries a Qwen2 tokenizer in the published layout; text prompts go through it as vLLM-Omni's
    BAGEL pipeline loads it (its special ids = config.json's), token-id prompts stay as written, and the 7B
    recipe's text prompts validate against a folder (its tokenizer) or, in a dry run, without one."""
    from megatron_omni.trainer.bagel import prompt_tokenizer
    from model_providers.bagel.provider import write_bagel_folder
    from model_providers.bagel.tokenizer import encode_prompt

    folder = write_bagel_folder(tmp_path / "bagel", "tiny")
    assert (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists()
    cfg = tiny()
    cfg.prompts = ["a red cat", "17 42"]
    tok = prompt_tokenizer(cfg, folder, get_family("bagel").config("tiny")["tokens"])
    ids = encode_prompt("a red cat", 128, tok)
    assert len(ids) == 9 and tok.decode(ids) == "a red cat" and min(ids) >= 5  # one byte each, no specials
    assert encode_prompt("17 42", 128, tok) == [17, 42]
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|vision_end|>"]) == [1, 4]
    cfg.validate(world_size=1)
    big = bagel_7b_h200()
    big.model.pipeline = str(folder)  # a folder at hand: its config and tokenizer check the recipe's OCR prompts
    big.rollout.height = big.rollout.width = 32  # the tiny folder's latent table
    big.validate(world_size=8)
    big.prompts = ['A "caf\u00e9" sign']
    with pytest.raises(ConfigError, match="caf"):
        big.validate(world_size=8)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer|tokenizer files"):
        big.validate(world_size=8)
    big.model.pipeline = str(tmp_path / "absent")
    big.validate(world_size=8, planning=True)  # a dry run plans from the preset
    with pytest.raises(ConfigError, match="model.pipeline"):
        big.validate(world_size=8)


def test_data_parallel_ranks_need_prompts_and_cp_runs_at_pp1() -> None:
    """A data-parallel rank without a prompt of its own (`rollout.prompts_per_step` < dp) is a config error naming
    the setting (the rollout failed on it); context parallelism validates at pp 1 and is refused at pp > 1."""
    cfg = tiny()
    cfg.rollout.prompts_per_step = 1
    cfg.validate(world_size=1)
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_step=1 must be >= the data-parallel size 2"):
        cfg.validate(world_size=2)
    cfg.parallel.tp = 2  # one model replica on the 2 ranks: dp 1
    cfg.validate(world_size=2)
    cfg.parallel.tp, cfg.parallel.ulysses = 1, 2
    cfg.validate(world_size=2)
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_step=1 must be >= the data-parallel size 2"):
        cfg.validate(world_size=4)
    cfg.rollout.prompts_per_step, cfg.parallel.ulysses, cfg.parallel.ring = 2, 1, 2
    cfg.validate(world_size=4)
    cfg.parallel.pp = 2
    with pytest.raises(ConfigError, match=r"parallel.ulysses/ring: context parallelism runs at pp 1 only"):
        cfg.validate(world_size=4)


def test_rollout_tp_equal_to_trainer_tp_validates() -> None:
    """`rollout.tp` = `parallel.tp` (the trainer's tp group holds one rollout pipeline's shards) at pp 1; refused at
    pp > 1 by name."""
    cfg = tiny()
    cfg.parallel.tp = cfg.rollout.tp = 2
    cfg.validate(world_size=2)
    cfg.parallel.tp, cfg.parallel.pp = 1, 2
    with pytest.raises(ConfigError, match="rollout.tp: must be 1 or parallel.tp at pp 1"):
        cfg.validate(world_size=2)
