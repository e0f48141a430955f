"""Image-editing RL end to end, as users run it: `--recipe examples.qwen_image_edit.recipe:tiny` (the tiny offline
edit pipeline built into the run folder, the shipped "write W on this image" records, the `edit_text` reward)
through `python -m megatron_omni.train`. One 8-step run is shared: the reward rises, the sample grid is written,
and a run SIGKILLed after its step-4 checkpoint resumes (`--resume auto`) to the same state, bit for bit.

Margin: mean reward of the last two steps minus the first two, measured +0.0017 at seed 0 (per-step sample std
about 0.0004; a random tiny model writes nothing legible, so the rise is the keep term's); asserted > 0.0008.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _assert_resumed_bit_identically, _killed_and_resumed_beside, _rewards

EDIT = ["--recipe", "examples.qwen_image_edit.recipe:tiny", "--set", "steps=8", "--set", "checkpoint.every=4",
        "--set", "checkpoint.keep=5"]
MARGIN = 0.0008


@pytest.fixture(scope="module")
def edit_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The 8-step run and, beside it, the same run SIGKILLed after its step-4 checkpoint and resumed: (run, killed,
    the resume)."""
    root = tmp_path_factory.mktemp("edit")
    proc, resumed = _killed_and_resumed_beside(root / "tp1", root / "killed", 4, *EDIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "tp1", root / "killed", resumed


@pytest.fixture(scope="module")
def edit_run(edit_runs: tuple) -> Path:
    return edit_runs[0]


def test_edit_reward_rises_and_the_grid_shows_source_and_output(edit_run: Path) -> None:
    r = _rewards(edit_run)
    rise = sum(r[-2:]) / 2 - sum(r[:2]) / 2
    print("edit tiny reward per step:", [f"{x:.4f}" for x in r], f"rise {rise:+.4f}")
    assert len(r) == 8 and rise > MARGIN, r
    assert (edit_run / "samples" / "step_0007.png").is_file()


def test_edit_run_resumes_bit_identically(edit_runs: tuple) -> None:
    edit_run, run, resumed = edit_runs
    _assert_resumed_bit_identically(edit_run, run, 8, resumed)
    assert _rewards(edit_run) == _rewards(run)
