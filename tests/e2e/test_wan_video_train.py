"""FlowGRPO on video end to end, as users run it: the Wan demo recipe (`examples.wan.recipe:wan_video_demo`, the
tiny offline Wan pipeline built into the run folder, temporal-consistency reward on frame strips) through
`python -m megatron_omni.train`. The reward rises at TP=1 and at CP=2 (Ulysses, torchrun), the run folder holds
the sample videos (GIF, MP4) beside the first-frame PNG grids, and a SIGKILLed run resumes bit-identically.

Margin: the mean reward of the last two of 8 steps minus that of the first two, measured at TP=1 over seeds
0 / 1 / 2: +0.0160 / +0.0076 / +0.0150 (the step's reward std is ~0.001-0.003); CP=2, seed 0: +0.0160. The
tests assert > 0.005, below the smallest."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _assert_resumed_bit_identically, _killed_and_resumed_beside, _rewards, _train

WAN = ["--recipe", "examples.wan.recipe:wan_video_demo", "--set", "steps=8"]
# The TP=1 run also evaluates held-out prompts before and after (ODE, 2 x 2 clips): video grids in eval/.
EVAL = ["--set", 'eval.prompts=["a red cat", "a blue ball"]', "--set", "eval.num_steps=6",
        "--set", "checkpoint.every=4", "--set", "checkpoint.keep=5"]
MARGIN = 0.005


def _rise(r: list[float]) -> float:
    return sum(r[-2:]) / 2 - sum(r[:2]) / 2


@pytest.fixture(scope="module")
def tp1_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """An uninterrupted TP=1 run of 8 steps, checkpoints after steps 4 and 8 (the resume test's reference), with a
    held-out evaluation before and after; beside it the same run SIGKILLed after its step-4 checkpoint and
    resumed: (run, killed, the resume)."""
    root = tmp_path_factory.mktemp("wan")
    proc, resumed = _killed_and_resumed_beside(root / "tp1", root / "killed", 4, *WAN, *EVAL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "tp1", root / "killed", resumed


@pytest.fixture(scope="module")
def tp1_run(tp1_runs: tuple) -> Path:
    return tp1_runs[0]


@pytest.mark.slow
def test_video_reward_rises_tp1_and_the_run_folder_holds_videos(tp1_run: Path) -> None:
    r = _rewards(tp1_run)
    print("wan tp=1 reward per step:", [f"{x:.4f}" for x in r], f"rise {_rise(r):+.4f}")
    assert len(r) == 8 and _rise(r) > MARGIN, r
    # image_every=0: the last step's samples, a first-frame PNG grid and the grid as a GIF of every frame
    samples = tp1_run / "samples"
    assert (samples / "step_0007.png").is_file()
    from PIL import Image

    with Image.open(samples / "step_0007.gif") as gif:
        assert gif.n_frames == 9  # rollout.num_frames
    for name in ("eval/step_0000.gif", "eval/step_0008.gif", "eval/step_0008.png", "eval_before_after.png"):
        assert (tp1_run / name).is_file(), name


@pytest.mark.slow
def test_video_reward_rises_cp2_ulysses_with_mp4(tmp_path: Path) -> None:
    run = tmp_path / "cp2"
    proc = _train(run, *WAN, "--set", "parallel.ulysses=2", "--set", "logging.video_format=mp4", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("wan cp=2 (ulysses) reward per step:", [f"{x:.4f}" for x in r], f"rise {_rise(r):+.4f}")
    assert _rise(r) > MARGIN, r
    mp4 = run / "samples" / "step_0007.mp4"
    assert mp4.is_file() and mp4.read_bytes()[4:8] == b"ftyp"


@pytest.mark.slow
def test_video_run_resumes_bit_identically(tp1_runs: tuple) -> None:
    tp1_run, run, resumed = tp1_runs
    _assert_resumed_bit_identically(tp1_run, run, 8, resumed)
    assert _rewards(tp1_run) == _rewards(run)
