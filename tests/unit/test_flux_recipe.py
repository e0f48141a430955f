"""The tiny FLUX.1 recipe validates; the distilled guidance setting is refused for a family whose models take none,
and true CFG is refused for FLUX (its rollout guides through the distilled guidance input), each by name."""

from __future__ import annotations

import pytest

from megatron_omni.train import main


def test_tiny_recipe_validates_and_its_guidance_settings_are_checked(monkeypatch: pytest.MonkeyPatch, capsys,
                                                                   tmp_path) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    # A folder that names the pipeline class stands in for the tiny pipeline (the check needs no weights).
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    flux = ["--check", "--recipe", "examples.flux.recipe:tiny", "--set", f"model.pipeline={tmp_path}"]
    assert main(flux) == 0
    assert main(["--check", "--recipe", "examples.sd3.recipe:tiny", "--set", "rollout.distilled_guidance=3.5"]) == 2
    assert "rollout.distilled_guidance=3.5 is not supported with model.family=sd3" in capsys.readouterr().err
    assert main([*flux, "--set", "rollout.guidance_scale=4.5", "--set", "rollout.negative_prompt=''"]) == 2
    assert "rollout.guidance_scale=4.5 is not supported with model.family=flux" in capsys.readouterr().err
