"""flow_grpo's SD3.5 recipes (`examples.sd3.recipe`) validate at the world sizes they are meant for (SD3.5-M on
one node of 8, SD3.5-L on two), with flow_grpo's settings; a dry run of the SD3 family is refused by name (the
planner has no SD3 cost model yet), exit status 2, no traceback."""

from __future__ import annotations

import pytest

from examples.sd3 import recipe
from megatron_omni.train import main


@pytest.mark.parametrize("name,world", [("sd35_medium_ocr", 8), ("sd35_medium_pickscore", 8),
                                        ("sd35_large_ocr", 16)])
def test_recipes_validate(name: str, world: int, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # The published pipeline is not on this machine: a folder that names its class stands in for the check.
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    monkeypatch.setenv("SD35_PIPELINE", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("OCR_PROMPTS", raising=False)
    assert main(["--check", "--recipe", f"examples.sd3.recipe:{name}"]) == 0


def test_flow_grpo_settings() -> None:
    ocr, pick = recipe.sd35_medium_ocr(), recipe.sd35_medium_pickscore()
    r = ocr.rollout
    assert (r.height, r.num_steps, r.noise_level, r.window_size, r.guidance_scale, r.group_size) == (
        512, 10, 0.7, 2, 4.5, 24)
    assert (ocr.algorithm.clip_range, ocr.optim.lr, ocr.model.lora.rank, ocr.model.lora.alpha) == (1e-4, 3e-4, 32, 64)
    assert (ocr.algorithm.beta, pick.algorithm.beta) == (0.04, 0.01)
    assert ocr.model.preset == "sd35-medium" and recipe.sd35_large_ocr().model.preset == "sd35-large"
    with pytest.raises(ValueError, match="unknown SD3.5 recipe reward"):
        recipe.sd35("medium", "geneval")


def test_dry_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path) -> None:
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    monkeypatch.setenv("SD35_PIPELINE", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["--dry-run", "--recipe", "examples.sd3.recipe:sd35_medium_ocr"]) == 2
    err = capsys.readouterr().err
    assert "no cost model" in err and "model.family=sd3" in err and "Traceback" not in err
