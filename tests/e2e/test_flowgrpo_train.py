"""The trainer end to end, as users run it (`python -m megatron_omni.train`, torchrun for TP=2):
the reward rises, a SIGKILLed run resumes bit-identically (EMA of the weights included), bypass and
recompute agree, bad configs fail before any work starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel.rank_pool import free_port
from tests.e2e import zygote

ROOT = Path(__file__).resolve().parents[2]
# A short run of the demo recipe: 4 prompts x 4 samples, 6 sampling steps, window 2.
SHORT = ["--set", "logging.tensorboard=false", "--set", "logging.image_every=0"]
WAN = ["--recipe", "examples.wan.recipe:wan_video_demo"]  # the tiny video demo (docs/video.md)
# A disaggregated placement of 1 trainer + 1 rollout rank (the bad-config table sets WORLD_SIZE=2 for it).
ASYNC = ["--set", "placement.mode=disaggregated", "--set", "placement.rollout_ranks=1", "--set", "checkpoint.every=0"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _command(run_dir: Path, *args: str, nproc: int = 1) -> list[str]:
    """`python -m megatron_omni.train` (through torchrun for `nproc` > 1), each rank forked from this worker's
    zygote (tests/e2e/zygote: the same rank without its interpreter's imports)."""
    rank = [*zygote.python_m("megatron_omni.train"), "--set", f"run_dir={run_dir}", *SHORT, *args]
    return rank if nproc == 1 else zygote.torchrun(nproc, free_port(), rank)


def _train(run_dir: Path, *args: str, nproc: int = 1, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(_command(run_dir, *args, nproc=nproc), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


class _Background:
    """`_train` started now and finished later: runs that do not depend on each other run at once (one-rank runs
    take one core each, OMP_NUM_THREADS=1; the machine has two), the suite's budget. `result()` waits and returns
    what `_train` would; leaving the `with` block kills the run if it is still going (a failed assertion). A thread
    reads the run's output as it comes: a run that logs more than a pipe holds must not stall until `result()`."""

    def __init__(self, run_dir: Path, *args: str, nproc: int = 1, timeout: float = 900) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(_command(run_dir, *args, nproc=nproc), cwd=ROOT, env=_env(), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.done: subprocess.CompletedProcess | None = None
        self._output: list[str] = []
        self._reader = threading.Thread(target=lambda: self._output.extend(self.proc.communicate()), daemon=True)
        self._reader.start()

    def result(self) -> subprocess.CompletedProcess:
        if self.done is None:
            self._reader.join(self.timeout)
            if self._reader.is_alive():
                self.__exit__()
                raise subprocess.TimeoutExpired(self.proc.args, self.timeout)
            out, err = self._output
            self.done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        return self.done

    def __enter__(self) -> _Background:
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._reader.join()


def _rewards(run_dir: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def reward_gain(r: list[float]) -> float:
    """How far the reward rose: the mean of the last two steps' rewards minus the mean of the first two."""
    return sum(r[-2:]) / 2 - sum(r[:2]) / 2


def _final_state(run_dir: Path, step: int) -> dict:
    """Model and optimizer tensors of a training checkpoint (a Megatron distributed checkpoint)."""
    from megatron_omni.trainer.checkpointing import read_checkpoint_tensors

    tensors = read_checkpoint_tensors(run_dir / "checkpoints" / f"step_{step:06d}")
    return {"model": tensors["model"], "optimizer": {"state": {0: tensors["optimizer"]}}}


def _assert_same_state(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        if torch.is_tensor(v):
            assert torch.equal(v, b["model"][k]), f"model tensor {k} differs"
    for pid, st in a["optimizer"]["state"].items():
        for name, t in st.items():
            if torch.is_tensor(t):
                assert torch.equal(t, b["optimizer"]["state"][pid][name]), f"optimizer state {pid}.{name} differs"


def _wait_for_checkpoint(proc: subprocess.Popen, run: Path, step: int) -> Path:
    """Wait (up to 10 minutes) until the running `proc`'s step-`step` checkpoint in `run` is complete or `proc` has
    ended; returns the checkpoint's COMPLETE marker (which exists only in the first case)."""
    marker = run / "checkpoints" / f"step_{step:06d}" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return marker


def _kill_after_checkpoint(run: Path, step: int, *args: str) -> None:
    """Start a run and SIGKILL it as soon as its step-`step` checkpoint is complete."""
    cmd = _command(run, *args)
    # Its own process group, killed whole below: the trainer and its helper processes die together, as when
    # a node is lost, and none is left behind idle.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        marker = _wait_for_checkpoint(proc, run, step)
    finally:  # also when the wait fails: nothing of the run may outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert marker.exists(), f"the run never reached its step-{step} checkpoint"


def _resumes_bit_identically(ref: Path, run: Path, kill_at: int, last: int, *args: str, killed: bool = False) -> None:
    """A run SIGKILLed after its step-`kill_at` checkpoint (here, or by the caller: `killed`) and resumed with
    `--resume auto` ends with the model and optimizer state of the uninterrupted run `ref` at step `last`, bit for
    bit."""
    if not killed:
        _kill_after_checkpoint(run, kill_at, *args)
    _assert_resumed_bit_identically(ref, run, last, _train(run, *args, "--resume", "auto"))


def _assert_resumed_bit_identically(ref: Path, run: Path, last: int, resumed: subprocess.CompletedProcess) -> None:
    """`resumed`, the `--resume auto` of the killed run `run`, resumed and ended with the model and optimizer state
    of the uninterrupted run `ref` at step `last`, bit for bit."""
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    _assert_same_state(_final_state(ref, last), _final_state(run, last))


def _killed_and_resumed_beside(ref: Path, run: Path, kill_at: int, *args: str) -> tuple[subprocess.CompletedProcess,
                                                                                        subprocess.CompletedProcess]:
    """The uninterrupted one-rank run `ref` and, at the same time on the other core, the same command into `run`
    SIGKILLed after its step-`kill_at` checkpoint and resumed with `--resume auto`: two lanes of about one run
    each instead of three runs one after another (the suite's budget). Returns (ref's run, the resume)."""
    with _Background(ref, *args) as uninterrupted:
        _kill_after_checkpoint(run, kill_at, *args)
        resumed = _train(run, *args, "--resume", "auto")
        return uninterrupted.result(), resumed


def _copy_checkpoint_when_complete(source: _Background, ref: Path, run: Path, at: int) -> None:
    """Wait until the running `source` (into `ref`) has completed its step-`at` checkpoint, then copy that checkpoint
    alone into `run`: what a run killed after it leaves to resume from (its later records are dropped on resume,
    `test_sigkill_and_resume_is_bit_identical`)."""
    marker = _wait_for_checkpoint(source.proc, ref, at)
    if not marker.exists():
        proc = source.result()
        pytest.fail(f"the run never reached its step-{at} checkpoint: rc {proc.returncode}\n{proc.stderr[-3000:]}")
    shutil.copytree(marker.parent, run / "checkpoints" / marker.parent.name)


def _resumed_beside(ref: Path, run: Path, at: int, *args: str, nproc: int = 1) -> tuple[subprocess.CompletedProcess,
                                                                                          subprocess.CompletedProcess]:
    """The uninterrupted run `ref` and, as soon as its step-`at` checkpoint is complete, a copy of that checkpoint
    in `run` resumed with `--resume auto` while `ref` goes on: the resumed process reads what a run killed after
    that checkpoint leaves, at the cost of one run and the resumed steps (not a killed run besides). Returns (ref's
    run, the resume)."""
    with _Background(ref, *args, nproc=nproc) as uninterrupted:
        _copy_checkpoint_when_complete(uninterrupted, ref, run, at)
        resumed = _train(run, *args, "--resume", "auto", nproc=nproc)
        return uninterrupted.result(), resumed


# bf16 model and engine with flow_grpo's fp32 VAE (`rollout.vae_dtype`; the VAE is outside what these runs check):
# on these AVX2 cores torch's bf16 3-D convolution has no oneDNN kernel (`slow_conv3d`, ~70% of a bf16 rollout).
FP32_VAE = ["--set", "rollout.vae_dtype=fp32"]
BF16 = ["--set", "model.params_dtype=bf16", "--set", "rollout.dtype=bf16", *FP32_VAE]


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, _Background]]]:
    """The module's independent one-rank runs, started together when the first of their tests needs one (each takes
    one core; they overlap each other and the tests in between): name -> (run folder, its `_Background`)."""
    root = tmp_path_factory.mktemp("one_rank")
    args = {"tp1": ["--set", "steps=8"], "bf16": ["--set", "steps=8", *BF16],
            # A bf16 engine against the fp32 trainer: a gap of ~1e-4.
            "gap": ["--set", "steps=2", "--set", "rollout.dtype=bf16", *FP32_VAE,
                    "--set", "algorithm.max_logp_gap=1e-7"]}
    runs = {name: (root / name, _Background(root / name, *a)) for name, a in args.items()}
    yield runs
    for _, run in runs.values():
        run.__exit__()


@pytest.mark.slow
def test_reward_rises_tp1(one_rank_runs: dict) -> None:
    run, background = one_rank_runs["tp1"]
    proc = background.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("tp=1 reward per step:", [f"{x:.3f}" for x in r])
    assert len(r) == 8
    assert reward_gain(r) > 0.05, r
    assert (run / "reward_curve.png").exists() and (run / "config.json").exists()
    assert any((run / "samples").glob("step_*.png"))


@pytest.mark.slow
def test_reward_rises_tp2(tmp_path: Path) -> None:
    run = tmp_path / "tp2"
    proc = _train(run, "--set", "steps=8", "--set", "parallel.tp=2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("tp=2 reward per step:", [f"{x:.3f}" for x in r])
    assert reward_gain(r) > 0.05, r


@pytest.mark.slow
def test_reward_rises_pp2(tmp_path: Path) -> None:
    run = tmp_path / "pp2"
    proc = _train(run, "--set", "steps=8", "--set", "parallel.pp=2", "--set", "optim.micro_batch_size=4", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("pp=2 reward per step:", [f"{x:.3f}" for x in r])
    assert reward_gain(r) > 0.05, r


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical(one_rank_runs: dict, tmp_path: Path) -> None:
    """With an EMA of the weights kept (optim.ema_decay): it is checkpointed and resumes bit-identically too."""
    steps = ["--set", "steps=4", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=5",
             "--set", "optim.ema_decay=0.9"]
    ref, run, plain = tmp_path / "uninterrupted", tmp_path / "killed", tmp_path / "plain"
    # The reference runs while the killed run runs and resumes.
    with _Background(ref, *steps) as uninterrupted:
        _kill_after_checkpoint(run, 2, *steps)
        resumed = _train(run, *steps, "--resume", "auto")  # while the reference still runs
        assert uninterrupted.result().returncode == 0, uninterrupted.result().stderr[-3000:]
        _assert_resumed_bit_identically(ref, run, 4, resumed)
    # A checkpoint without an EMA cannot resume a job that keeps one (asserted below): the EMA-less run is a copy of
    # the module's plain one-rank run (the same demo recipe without optim.ema_decay; one start fewer than a run of
    # its own), and that start runs while this process exports the EMA.
    without_ema = one_rank_runs["tp1"]
    assert without_ema[1].result().returncode == 0, without_ema[1].result().stderr[-3000:]
    shutil.copytree(without_ema[0], plain)
    with _Background(plain, "--set", "steps=9", "--set", "optim.ema_decay=0.9", "--resume", "auto") as refusing:
        assert _rewards(ref)[-1] == _rewards(run)[-1]
        model = _final_state(ref, 4)["model"]
        ema = [k for k in model if k.startswith("ema.")]
        assert ema and all(k.removeprefix("ema.") in model for k in ema)
        assert any(not torch.equal(model[k], model[k.removeprefix("ema.")]) for k in ema), \
            "the EMA must lag the weights"
        # `mcore-to-hf --prefix ema.` exports the EMA: the same diffusers tensors, other values.
        from safetensors.torch import load_file

        from megatron_omni.checkpoint.convert import mcore_to_hf

        exports = {}
        for name, prefix in (("weights", ""), ("ema", "ema.")):
            mcore_to_hf(ref / "checkpoints" / "step_000004", tmp_path / name, prefix=prefix, progress=False)
            exports[name] = {k: v for f in sorted((tmp_path / name).glob("*.safetensors"))
                             for k, v in load_file(f).items()}
        assert exports["weights"].keys() == exports["ema"].keys()
        assert any(not torch.equal(v, exports["ema"][k]) for k, v in exports["weights"].items())
        refused = refusing.result()
    assert refused.returncode != 0 and "holds no EMA of the weights" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.slow
def test_fp8_rollout_reward_rises_and_resumes_bit_identically(tmp_path: Path) -> None:
    """`rollout.quantization=fp8` with the truncated importance weights (cap 2): the engine's own copy samples
    in FP8 (ModelOpt fake quantization), every sync passes the quantized probe check, the rollout/trainer gap
    is logged > 0 and small, the reward rises as in bf16, and a run resumed from its step-4 checkpoint ends
    bit-identical (the quantizer's state is rebuilt from the synced weights)."""
    steps = ["--set", "steps=8", "--set", "rollout.quantization=fp8", "--set", "algorithm.is_cap=2",
             "--set", "checkpoint.every=4", "--set", "checkpoint.keep=5"]
    ref, run = tmp_path / "uninterrupted", tmp_path / "resumed"
    proc, resumed = _resumed_beside(ref, run, 4, *steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(ref)
    records = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    print("fp8 reward per step:", [f"{x:.3f}" for x in r])
    print("fp8 |dlogp| per step:", [f"{m['train_rollout_dlogp']:.2e}" for m in records])
    print("fp8 probe quantizer move / bound:", [f"{m['sync_probe_quant_diff']:.3g}/{m['sync_probe_quant_bound']:.3g}"
                                                for m in records])
    assert reward_gain(r) > 0.05, r
    for m in records:
        assert 0 < m["train_rollout_dlogp"] < 1e-2 and 0 < m["sync_probe_quant_diff"] <= m["sync_probe_quant_bound"]
        assert m["is_truncated_frac"] == 0.0 and m["is_weight_max"] <= 2.0

    _assert_resumed_bit_identically(ref, run, 8, resumed)
    assert _rewards(ref) == _rewards(run)


@pytest.mark.slow
def test_bypass_and_recompute_give_the_same_first_update(tmp_path: Path) -> None:
    a, b = tmp_path / "recompute", tmp_path / "bypass"
    # The engine samples with its own diffusers copy (not the trainer's module), so the two implementations
    # must agree.
    own = ["--set", "steps=1", "--set", "rollout.transformer=engine"]
    with _Background(a, *own) as recompute, _Background(b, *own, "--set", "algorithm.old_logprob=bypass") as bypass:
        assert recompute.result().returncode == 0, recompute.result().stderr[-3000:]
        assert bypass.result().returncode == 0, bypass.result().stderr[-3000:]
    sa, sb = _final_state(a, 1), _final_state(b, 1)
    # The rollout and trainer log-probs agree to ~1e-8, not bit for bit, and Adam's first step is nearly
    # sign(grad) * lr: the updates must agree to 0.1% of one step (lr = 3e-3 in the demo recipe).
    lr = 3e-3
    for k, v in sa["model"].items():
        if torch.is_tensor(v):
            torch.testing.assert_close(v, sb["model"][k], rtol=0, atol=1e-3 * lr, msg=f"{k} differs")
    # The recorded rollout/trainer log-prob gap that makes them agree.
    dlogp = json.loads((a / "metrics.jsonl").read_text().splitlines()[0])["train_rollout_dlogp"]
    assert dlogp < 1e-6


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "rollout.nope=1"], "unknown field 'nope'"),
        (["--set", "optim.lr=fast"], "optim.lr='fast': not a valid float"),
        (["--set", "parallel.tp=3"], "world size 1 is not divisible"),
        (["--set", "rollout.group_size=1"], "rollout.group_size=1"),
        (["--set", "eval.guidance_scale=0.5"], "eval.guidance_scale=0.5"),
        (["--set", "eval.rollout_sampler=true", "--set", "algorithm.name=diffusionnft"],
         "eval.rollout_sampler=True with algorithm.name=diffusionnft"),
        (["--set", "rollout.noise_level=0"], "rollout.noise_level=0.0 with algorithm.name=flowgrpo"),
        (["--set", "optim.ema_decay=1"], "optim.ema_decay=1.0"),
        (["--set", "rollout.window_size=4", "--set", "rollout.window_range=[0,2]"],
         "rollout.window_range=[0, 2] is shorter than rollout.window_size=4"),
        (["--set", "rollout.guidance_scale=3"], "rollout: guidance_scale > 1 (true CFG) needs a negative_prompt"),
        (["--set", "parallel.tp=2", "--set", "rollout.transformer=trainer"], "rollout.transformer='trainer'"),
        (["--recipe", "examples.tiny.recipe:missing"], "--recipe"),
        (["--set", "model.backend=foo"], "model.backend='foo' must be local|te"),
        (["--set", "model.backend=te"], "needs the transformer_engine package"),
        (["--set", "model.backend=te", "--dry-run"], "needs the transformer_engine package"),
        (["--set", "model.backend=foo", "--dry-run"], "model.backend='foo'"),
        (["--set", "model.params_dtype=fp16"], "model.params_dtype='fp16' must be fp32|bf16"),
        (["--set", "rollout.dtype=half", "--dry-run"], "rollout.dtype='half' must be fp32|bf16"),
        (["--set", "rollout.engine=sglang"], "rollout.engine='sglang' must be diffusers|vllm_omni"),
        (["--set", "rollout.tp=2"], "rollout.tp=2 > 1 needs rollout.engine=vllm_omni"),
        (["--set", "rollout.engine=vllm_omni", "--set", "rollout.tp=2"], "rollout.tp=2 does not divide"),
        (["--set", "algorithm.clip_range=0"], "algorithm.clip_range=0.0 must be > 0"),
        (["--set", "algorithm.max_logp_gap=-1"], "algorithm.max_logp_gap=-1.0"),
        (["--set", "optim.lr=0"], "optim.lr=0.0 must be > 0"),
        # What the Wan (video) family does not support yet, by its traits, and frames / scorers / folders that
        # do not fit the family
        ([*WAN, "--set", "algorithm.name=mixgrpo", "--set", "algorithm.mixgrpo.flash_ratio=0.4"],
         "algorithm.mixgrpo.flash_ratio=0.4 is not supported with model.family=wan"),
        ([*WAN, "--set", "rollout.quantization=fp8"], "rollout.quantization='fp8' with model.family=wan"),
        ([*WAN, "--set", "rollout.num_frames=8"], "rollout.num_frames=8 with model.family=wan: num_frames - 1"),
        ([*WAN, "--set", "reward.video_frames=0"], "reward.video_frames=0 must be >= 1"),
        ([*WAN, "--set", "model.pipeline=examples/tiny/text_pipeline"],
         "holds a QwenImagePipeline and model.family=wan trains a WanPipeline"),
        (["--set", "rollout.num_frames=9"], "rollout.num_frames=9 with model.family=qwen_image"),
        (["--set", "reward.scorer=temporal_consistency"],
         "reward.scorer='temporal_consistency' with model.family=qwen_image"),
        (["--set", "logging.video_format=avi"], "logging.video_format='avi' must be gif|mp4"),
        # The asynchronous rollout (docs/async.md): the placement, its bounds, and what it cannot serve yet
        (["--set", "placement.mode=split"], "placement.mode='split' must be colocated|disaggregated"),
        (["--set", "async.max_staleness=1"], "async.max_staleness=1 with placement.mode='colocated'"),
        (["--set", "placement.rollout_ranks=1"], "placement.rollout_ranks=1 with placement.mode='colocated'"),
        ([*ASYNC, "--set", "placement.rollout_ranks=0"], "placement.rollout_ranks is required"),
        ([*ASYNC, "--set", "rollout.engine=vllm_omni", "--set", "rollout.tp=2"],
         "placement.rollout_ranks=1 rollout ranks with rollout.tp=2: each engine takes 2 rollout ranks"),
        (["--set", "placement.mode=disaggregated", "--set", "placement.rollout_ranks=1"],
         "placement.rollout_ranks=1: a count must be in [1, 0] for 1 ranks"),
        (["--set", "async.heartbeat_s=30"], "async.heartbeat_s=30.0 must be <= async.liveness_timeout_s / 3"),
        (["--set", "async.liveness_timeout_s=0"], "async.liveness_timeout_s=0.0 must be > 0"),
        (["--set", "async.stall_timeout_s=-1"], "async.stall_timeout_s=-1.0 must be > 0"),
        ([*ASYNC, "--set", "algorithm.name=diffusionnft", "--set", "rollout.noise_level=0"],
         "algorithm.name='diffusionnft' is not supported with placement.mode=disaggregated"),
        ([*ASYNC, "--set", "rollout.engine=vllm_omni", "--set", "rollout.vllm_omni_process=inline"],
         "rollout.vllm_omni_process='inline' is not supported with placement.mode=disaggregated"),
        ([*ASYNC, "--set", "rollout.transformer=trainer"],
         "rollout.transformer='trainer' is not supported with placement.mode=disaggregated"),
        ([*ASYNC, "--set", "model.lora.rank=4", "--set", "rollout.lora_sync=adapter"],
         "rollout.lora_sync='adapter' is not supported with placement.mode=disaggregated"),
        ([*WAN, *ASYNC], "model.family='wan' is not supported with placement.mode=disaggregated"),
    ],
)
def test_bad_config_fails_before_work(tmp_path: Path, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    """The entry point's `main` in this process (one megatron-core import for the whole table; the exit status
    through a real process is `test_bad_config_exits_2_from_the_command_line`): 2, the message, no run folder,
    and never the job's start."""
    from megatron_omni import train
    from megatron_omni.parallel import platform

    def started(*_: object, **__: object) -> None:
        raise AssertionError("the bad config was accepted: the entry point started the job")

    monkeypatch.setattr(platform, "init_distributed", started)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    if args[:len(ASYNC)] == ASYNC or args[len(WAN):len(WAN) + len(ASYNC)] == ASYNC:
        monkeypatch.setenv("WORLD_SIZE", "2")  # one trainer rank and one rollout rank
    monkeypatch.chdir(ROOT)
    run = tmp_path / "bad"
    assert train.main(["--set", f"run_dir={run}", *SHORT, *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err[-2000:]
    assert not run.exists(), "a bad config must not create the run folder"


@pytest.mark.parametrize("args,message", [(["--set", "rollout.nope=1"], "unknown field 'nope'"),
                                          (["--set", "rollout.dtype=half", "--dry-run"], "rollout.dtype='half'")])
def test_bad_config_exits_2_from_the_command_line(tmp_path: Path, args: list[str], message: str) -> None:
    run = tmp_path / "bad"
    proc = _train(run, *args, timeout=300)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr[-2000:]
    assert not run.exists(), "a bad config must not create the run folder"


def test_dry_run_prints_the_plan_without_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point's `main` in this process (a dry run returns; the command line's exit statuses are
    `test_bad_config_exits_2_from_the_command_line`'s and the launch scripts')."""
    from megatron_omni import train
    from tests.e2e.in_process import call_main

    monkeypatch.chdir(ROOT)
    run = tmp_path / "dry"
    proc = call_main(train.main, ["--set", f"run_dir={run}", *SHORT, "--dry-run"], env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "memory per GPU" in proc.stdout and "images/s/GPU" in proc.stdout
    assert not run.exists()


@pytest.mark.slow
def test_reward_rises_bf16(one_rank_runs: dict) -> None:
    """bf16 mixed precision end to end: bf16 model and engine (sharing the module at one rank; its VAE fp32, as
    flow_grpo's), fp32 main params and Adam state, fp32 SDE math and log-probs."""
    run, background = one_rank_runs["bf16"]
    proc = background.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("bf16 reward per step:", [f"{x:.3f}" for x in r])
    assert reward_gain(r) > 0.05, r
    model = _final_state(run, 8)["model"]
    assert {v.dtype for v in model.values() if torch.is_tensor(v)} == {torch.bfloat16}


@pytest.mark.slow
def test_bf16_distributed_optimizer_resumes_bit_identically(tmp_path: Path) -> None:
    """DP=2 with Megatron-Core's distributed optimizer in bf16 (fp32 main params sharded over data parallel):
    a run resumed from its step-2 checkpoint ends at the uninterrupted run's weights and optimizer state."""
    args = ["--set", "checkpoint.every=1", "--set", "checkpoint.keep=5", "--set", "optim.distributed_optimizer=true",
            *BF16]
    ref, run = tmp_path / "uninterrupted", tmp_path / "resumed"
    # The resume starts from a copy of the step-2 checkpoint while the uninterrupted run does its step 3.
    done, proc = _resumed_beside(ref, run, 2, "--set", "steps=3", *args, nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = _final_state(ref, 3), _final_state(run, 3)
    assert a["optimizer"]["state"][0], "the checkpoint holds no optimizer state"
    _assert_same_state(a, b)
    assert _rewards(ref)[-1] == _rewards(run)[-1]


@pytest.mark.slow
def test_a_log_prob_gap_above_the_bound_exits_4(one_rank_runs: dict) -> None:
    proc = one_rank_runs["gap"][1].result()
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "train/rollout mismatch: step 0: mean |logp_trainer - logp_rollout|" in proc.stderr, proc.stderr[-2000:]
    assert "exceeds algorithm.max_logp_gap = 1.000e-07" in proc.stderr
