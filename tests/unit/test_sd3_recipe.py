"""flow_grpo's SD3.5 recipes (`examples.sd3.recipe`) validate at the world sizes they are meant for (SD3.5-M on
one node of 8, SD3.5-L on two), with flow_grpo's settings; their dry runs plan layouts that fit on an H800, and
layouts the SD3 model cannot run (CP, PP) are refused by name."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("name,world,gpu,reward_gpus", [("sd35_medium_ocr", 6, "H800", 2),
                                                        ("sd35_large_pickscore", 16, "H800", 0)])
def test_dry_run_plans_and_fits(name: str, world: int, gpu: str, reward_gpus: int, monkeypatch: pytest.MonkeyPatch,
                                capsys) -> None:
    """The planner's SD3 cost model: the launch scripts' layouts fit on an H800 (the H200 dry runs are the launch
    scripts' own, tests/e2e/test_launch_scripts.py); the text stream is CLIP's 77 + T5's 128 tokens."""
    monkeypatch.setenv("SD35_PIPELINE", "/nonexistent/sd35")  # no folder here: the recipe's preset is planned
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("OCR_PROMPTS", raising=False)
    assert main(["--dry-run", "--gpu", gpu, "--reward-gpus", str(reward_gpus), "--recipe",
                 f"examples.sd3.recipe:{name}"]) == 0
    out = capsys.readouterr().out
    assert "1024 image + 205 text tokens" in out and f"x {gpu}:" in out and "dry run OK" in out
    assert re.search(r"total +[\d.]+ GiB of 79\.6 GiB -> fits", out), out[-2000:]


def test_context_parallel_dry_run_where_it_pays(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """SD3.5-Large at 2048^2 (16384 image tokens) on 16 H200: its 38 heads split over tp 2 only, where the activations
    need full recompute (64.9 GiB, 1569.5 s/step planned); Ulysses 2 x ring 2 fits without recompute (123.6 GiB,
    1387.8 s/step). A layout the blocks do not split into is still refused by name."""
    monkeypatch.setenv("SD35_PIPELINE", "/nonexistent/sd35")
    monkeypatch.setenv("WORLD_SIZE", "16")
    big = ["--set", "rollout.height=2048", "--set", "rollout.width=2048"]
    assert main(["--dry-run", "--gpu", "H200", "--recipe", "examples.sd3.recipe:sd35_large_ocr", *big,
                 "--set", "parallel.ulysses=2", "--set", "parallel.ring=2"]) == 0
    out = capsys.readouterr().out
    assert "16384 image" in out and "dry run OK" in out, out[-2000:]
    assert re.search(r"activations +77\.2 GiB +\(none: 77\.2", out), out[-2000:]
    assert main(["--dry-run", "--gpu", "H200", "--recipe", "examples.sd3.recipe:sd35_large_ocr", *big,
                 "--set", "parallel.tp=2"]) != 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "12")
    assert main(["--dry-run", "--recipe", "examples.sd3.recipe:sd35_large_ocr", "--set", "parallel.pp=3"]) == 2
    err = capsys.readouterr().err
    assert "38 transformer blocks are not divisible by pp" in err and "Traceback" not in err, err
