"""`model.family=bagel` through the one trainer's config checks: the family is registered as data (kind "mot", its
trainer module named), the tiny recipe validates, and what the BAGEL trainer does not support is refused naming
the setting."""

from __future__ import annotations

import pytest

from examples.bagel.recipe import tiny
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
    ("parallel.pp", 2, "parallel"),
    ("model.lora.rank", 4, "model.lora.rank"),
    ("algorithm.beta", 0.1, "algorithm.beta"),
    ("rollout.height", 40, "rollout.height"),
    ("model.preset", "huge", "model.preset"),
    ("prompts", ["a red cat"], "token ids"),
    ("rollout.window_size", 9, "window"),
])
def test_unsupported_settings_refused_by_name(field: str, value, named: str) -> None:
    cfg = tiny()
    *path, last = field.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)
    with pytest.raises(ConfigError, match=named):
        cfg.validate(world_size=2 if field == "parallel.pp" else 1)
