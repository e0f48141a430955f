"""FlowGRPO on video end to end, as users run it: the Wan demo recipe (`examples.wan.recipe:wan_video_demo`, the
tiny offline Wan pipeline built into the run folder, temporal-consistency reward on frame strips) through
`python -m megatron_omni.train`. The reward rises at TP=1 with true CFG (WanPipeline's guidance 5.0 and a negative
prompt, in rollout, recompute and the held-out evaluation) on image-to-video in Wan2.2-TI2V-5B's layout (the tiny
folder of that layout, image-record prompts: each clip's first latent frame its image), at CP=2 (Ulysses,
torchrun, no CFG, text-to-video) and on the vLLM-Omni engine (its `Omni` engine in a worker process, CFG,
text-to-video); the run folder holds the sample videos (GIF, MP4) beside the first-frame PNG grids, and a SIGKILLed
image-to-video CFG run resumes bit-identically.

Margin: the mean reward of the last two of 8 steps minus that of the first two. Without CFG, measured at TP=1 over
seeds 0 / 1 / 2: +0.0160 / +0.0076 / +0.0150 (the step's reward std is ~0.001-0.003); CP=2, seed 0: +0.0160: the
test asserts > 0.005, below the smallest. With CFG 5.0 at TP=1, seeds 0 / 1 / 2: +0.0066 / +0.0070 / +0.0085: the
test asserts > 0.004 (text-to-video on the tiny folder; image-to-video on the TI2V folder, the run the test makes,
seeds 0 / 1: +0.0163 / +0.0087; train/rollout |dlogp| 0). With CFG 5.0 on the vLLM-Omni engine (on the tiny folder
with head dim 12: `wan_pipeline.check_rope_split`), in the rank (`rollout.vllm_omni_process=inline`), seeds 0 / 1 / 2:
+0.0065 / +0.0120 / +0.0121, train/rollout |dlogp| <= 3.6e-7; served by its `Omni` engine from a worker process (the
default, the run the test makes), seed 0: +0.0069: the test asserts > 0.004 and |dlogp| < 1e-5."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.distributed.test_wan_vllm_omni import make_folder
from tests.e2e.test_flowgrpo_train import _assert_resumed_bit_identically, _killed_and_resumed_beside, _rewards, _train

WAN = ["--recipe", "examples.wan.recipe:wan_video_demo", "--set", "steps=8"]
# The TP=1 run also evaluates held-out prompts before and after (ODE, 2 x 2 clips): video grids in eval/.
EVAL = ["--set", 'eval.prompts=["a red cat", "a blue ball"]', "--set", "eval.num_steps=6",
        "--set", "checkpoint.every=4", "--set", "checkpoint.keep=5"]
# True CFG as WanPipeline applies it (its default scale; the tiny byte tokenizer gives no token for "", the
# pipeline's default negative prompt, so a short one).
CFG = ["--set", "rollout.guidance_scale=5", "--set", "rollout.negative_prompt=blurry"]
MARGIN = 0.005
CFG_MARGIN = 0.004


def _rise(r: list[float]) -> float:
    return sum(r[-2:]) / 2 - sum(r[:2]) / 2


def ti2v_job(root: Path) -> list[str]:
    """The overrides of an image-to-video job on the tiny folder in Wan2.2-TI2V-5B's layout (built under `root`):
    the demo's four prompts as image records (a gradient, a checkerboard, stripes, ...: each clip's first latent
    frame is its image's latents), 64 x 64 clips (16x spatial compression: the demo's 3 x 2 x 2 patch grid)."""
    import torch
    from PIL import Image

    from model_providers.qwen_image_edit.data import EditRecord
    from model_providers.wan.tiny_pipeline import make_tiny_ti2v_pipeline

    folder = make_tiny_ti2v_pipeline(root / "ti2v", seed=0)
    y, x = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    arrays = [torch.stack([x * 4, y * 4, (x + y) * 2], -1), ((x // 8 + y // 8) % 2 * 255)[..., None].repeat(1, 1, 3),
              torch.stack([255 - x * 4, y * 2, x * 3], -1), ((x // 16) % 2 * 200)[..., None].repeat(1, 1, 3)]
    records = []
    for i, (a, text) in enumerate(zip(arrays, TI2V_TEXTS, strict=True)):
        path = root / f"image{i}.png"
        Image.fromarray(a.clamp(0, 255).to(torch.uint8).numpy()).save(path)
        records.append(EditRecord(str(path), text).prompt)
    return ["--set", f"model.pipeline={folder}", "--set", f"prompts={json.dumps(records)}",
            "--set", "rollout.height=64", "--set", "rollout.width=64"]


TI2V_TEXTS = ["a red cat", "waves on a beach", "a city street at night", "a spinning top"]


@pytest.fixture(scope="module")
def tp1_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """An uninterrupted TP=1 image-to-video run (Wan2.2-TI2V-5B's layout, `ti2v_job`) of 8 steps with true CFG,
    checkpoints after steps 4 and 8 (the resume test's reference), with a held-out text-to-video evaluation (guided
    too) before and after; beside it the same run SIGKILLed after its step-4 checkpoint and resumed: (run, killed,
    the resume)."""
    root = tmp_path_factory.mktemp("wan")
    proc, resumed = _killed_and_resumed_beside(root / "tp1", root / "killed", 4, *WAN, *CFG, *EVAL, *ti2v_job(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "tp1", root / "killed", resumed


@pytest.fixture(scope="module")
def tp1_run(tp1_runs: tuple) -> Path:
    return tp1_runs[0]


@pytest.mark.slow
def test_image_to_video_reward_rises_tp1_with_cfg_and_the_run_folder_holds_videos(tp1_run: Path) -> None:
    r = _rewards(tp1_run)
    print("wan ti2v image-to-video tp=1 cfg 5 reward per step:", [f"{x:.4f}" for x in r], f"rise {_rise(r):+.4f}")
    assert len(r) == 8 and _rise(r) > CFG_MARGIN, r
    config = json.loads((tp1_run / "config.json").read_text())
    assert config["rollout"]["guidance_scale"] == 5.0 and all(p.startswith('{"image"') for p in config["prompts"])
    # the trainer's recompute guides as the rollout did (plain guidance, the negative rows carried) and sees the
    # image condition as it did (the first frame's tokens clean, at t = 0, without a log-prob)
    lines = (tp1_run / "metrics.jsonl").read_text().splitlines()
    gaps = [json.loads(line)["train_rollout_dlogp_max"] for line in lines]
    assert max(gaps) < 1e-5, gaps
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
def test_video_run_with_cfg_resumes_bit_identically(tp1_runs: tuple) -> None:
    tp1_run, run, resumed = tp1_runs
    _assert_resumed_bit_identically(tp1_run, run, 8, resumed)
    assert _rewards(tp1_run) == _rewards(run)


@pytest.mark.slow
def test_video_reward_rises_with_cfg_on_the_vllm_omni_engine(tmp_path: Path) -> None:
    """rollout.engine=vllm_omni as the trainer runs it by default (`rollout.vllm_omni_process=engine`: vLLM-Omni's own
    `Omni` engine serving our FlowGRPOWanPipeline from a worker process), true CFG 5.0: every step's weights reach
    the worker's Wan transformer over `collective_rpc` (probed), the Megatron recompute agrees with its trajectories,
    and the reward rises."""
    run = tmp_path / "vllm"
    proc = _train(run, *WAN, *CFG, "--set", f"model.pipeline={make_folder(tmp_path)}", "--set",
                  "rollout.engine=vllm_omni")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker processes (rank: pid) {0: " in proc.stdout + proc.stderr  # served, not in the rank
    r = _rewards(run)
    print("wan vllm-omni cfg 5 reward per step:", [f"{x:.4f}" for x in r], f"rise {_rise(r):+.4f}")
    assert len(r) == 8 and _rise(r) > CFG_MARGIN, r
    gaps = [json.loads(line)["train_rollout_dlogp_max"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(gaps) < 1e-5, gaps


@pytest.mark.slow
def test_two_trainer_ranks_share_a_served_engine_at_rollout_tp2(tmp_path: Path) -> None:
    """rollout.tp=2 on the served engine under torchrun (2 trainer ranks, dp 2, CFG 5.0): the first rank owns one
    `Omni` engine with two worker processes (the transformer sharded), the other sends it its share of every step;
    the weights reach both workers after each update (probed) and both ranks' recomputes agree with their
    trajectories. 3 steps."""
    run = tmp_path / "vllm_tp2"
    proc = _train(run, *WAN, *CFG, "--set", "steps=3", "--set", "checkpoint.every=0", "--set",
                  f"model.pipeline={make_folder(tmp_path)}", "--set", "rollout.engine=vllm_omni", "--set",
                  "rollout.tp=2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "vLLM-Omni engine of trainer ranks [0, 1]: worker processes (rank: pid) {0: " in out and ", 1: " in out
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    probes, gaps = [m["sync_probe_max_diff"] for m in metrics], [m["train_rollout_dlogp_max"] for m in metrics]
    print(f"wan served rollout tp 2, 2 trainer ranks: reward per step {[f'{x:.4f}' for x in _rewards(run)]}, probe "
          f"{max(probes):.1e}, |dlogp| {max(gaps):.1e}")
    assert len(metrics) == 3 and max(probes) < 1e-5 and max(gaps) < 1e-5, (probes, gaps)


@pytest.mark.slow
def test_a14b_two_experts_reward_rises_with_low_noise_guidance(tmp_path: Path) -> None:
    """The tiny Wan2.2-A14B folder (`--family wan-a14b`: a high-noise and a low-noise expert, boundary 0.875): the
    low-noise expert trains (the window on steps 2-4, its steps), true CFG 5.0 on the high-noise expert's steps and
    `rollout.guidance_scale_2=2` on the low-noise expert's, as `WanPipeline` guides. Measured at seeds 0 / 1 / 2:
    +0.0073 / +0.0069 / +0.0063, train/rollout |dlogp| 0: the test asserts > CFG_MARGIN and |dlogp| < 1e-5."""
    from model_providers.wan.tiny_pipeline import make_tiny_a14b_pipeline

    folder = make_tiny_a14b_pipeline(tmp_path / "a14b", seed=0)
    run = tmp_path / "a14b_run"
    proc = _train(run, *WAN, *CFG, "--set", f"model.pipeline={folder}", "--set", "rollout.window_range=[2,5]",
                  "--set", "rollout.guidance_scale_2=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("wan a14b cfg 5 / 2 reward per step:", [f"{x:.4f}" for x in r], f"rise {_rise(r):+.4f}")
    assert len(r) == 8 and _rise(r) > CFG_MARGIN, r
    gaps = [json.loads(line)["train_rollout_dlogp_max"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(gaps) < 1e-5, gaps
    assert json.loads((run / "config.json").read_text())["rollout"]["guidance_scale_2"] == 2.0


@pytest.mark.slow
def test_a14b_diffusionnft_trains_the_low_noise_expert_at_its_levels(tmp_path: Path) -> None:
    """DiffusionNFT on the tiny Wan2.2-A14B folder: the ODE rollout runs both experts (CFG 5.0 / 2.0), and the policy,
    the low-noise expert, trains at the grid's low-noise levels only (`trainer.flowgrpo.nft_grids`: every drawn
    level below the boundary 0.875), 2 steps with a non-zero gradient."""
    from model_providers.wan.tiny_pipeline import make_tiny_a14b_pipeline

    folder = make_tiny_a14b_pipeline(tmp_path / "a14b", seed=0)
    run = tmp_path / "a14b_nft"
    proc = _train(run, *WAN, *CFG, "--set", "steps=2", "--set", f"model.pipeline={folder}",
                  "--set", "rollout.guidance_scale_2=2", "--set", "algorithm.name=diffusionnft",
                  "--set", "rollout.noise_level=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    hist = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    print("wan a14b nft:", [{k: h[k] for k in ("reward_mean", "grad_norm", "nft_sigma_max", "policy_loss")}
                            for h in hist])
    assert len(hist) == 2 and all(h["grad_norm"] > 0 for h in hist), hist
    assert all(0 < h["nft_sigma_max"] < 0.875 for h in hist), hist
