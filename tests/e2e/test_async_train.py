"""The asynchronous trainer end to end (`placement.mode=disaggregated`, docs/async.md), as users run it: one
trainer rank and one rollout rank under torchrun. Staleness 0 is the synchronous colocated trainer bit for bit;
staleness 1 learns, with every trajectory's policy version within the bound; a killed rollout rank stops the
trainer with its rank and step named, within the liveness bound; the whole job SIGKILLed after a checkpoint and
resumed with `--resume auto` ends equal to the uninterrupted run (the step sampled ahead is in the checkpoint)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from megatron_omni.parallel.rank_pool import free_port
from tests.e2e import zygote
from tests.e2e.test_flowgrpo_train import (
    ROOT,
    _assert_same_state,
    _Background,
    _command,
    _env,
    _final_state,
    _rewards,
    _train,
    reward_gain,
)

# One trainer rank + one rollout rank; checkpoints only at the end unless a test asks for more.
ASYNC = ["--set", "placement.mode=disaggregated", "--set", "placement.rollout_ranks=1", "--set", "checkpoint.every=0"]
# The metrics that depend on timing or exist on one side only (the colocated sync's probe is the rollout rank's
# swap probe here, checked there).
NOT_COMPARABLE = ("time_", "images_per_s", "staleness_", "policy_version_", "push_s", "behaviour_dlogp",
                  "sync_probe")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _start_ranks(run: Path, *args: str, world: int = 2,
                 rank_env: dict[int, dict[str, str]] | None = None) -> list[subprocess.Popen]:
    """The ranks of a job started as torchrun starts them (env://), each in its own session (killed whole by the
    caller); `rank_env`: more variables for some ranks."""
    port = free_port()
    cmd = _command(run, *args)
    procs = []
    for rank in range(world):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               **(rank_env or {}).get(rank, {})}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    return procs


def _wait_until(done: Callable[[], bool], procs: list[subprocess.Popen], what: str, timeout_s: float = 600) -> None:
    """Poll `done` while every rank runs; a rank that exits first (or the timeout) fails the test with each rank's
    exit code and the end of its stderr."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if any(q.poll() is not None for q in procs) or time.monotonic() > deadline:
            _kill_all(procs)
            tails = "\n".join(f"rank {r} exited {q.returncode}: {q.communicate()[1][-2000:]}"
                               for r, q in enumerate(procs))
            raise AssertionError(f"{what}:\n{tails}")
        time.sleep(0.02)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()


@pytest.mark.slow
def test_staleness_zero_equals_the_synchronous_colocated_trainer(tmp_path: Path) -> None:
    """max_staleness=0 through the rollout service (gloo transport, back buffer, swap, probe) gives the metrics
    and the final model and optimizer state of the colocated trainer whose engine samples with its own copy."""
    steps = ["--set", "steps=3", "--set", "checkpoint.every=0", "--set", "rollout.transformer=engine"]
    col, dis = tmp_path / "colocated", tmp_path / "disaggregated"
    with _Background(col, *steps) as colocated, _Background(dis, *steps, *ASYNC, nproc=2) as disaggregated:
        for p in (colocated.result(), disaggregated.result()):
            assert p.returncode == 0, p.stderr[-3000:]
    a, b = _metrics(col), _metrics(dis)
    assert len(a) == len(b) == 3
    for k, (x, y) in enumerate(zip(a, b)):
        same = {m: x[m] for m in x if not m.startswith(NOT_COMPARABLE)}
        assert same == {m: y[m] for m in same}, f"step {k}"
        assert y["staleness_0"] == 1.0 and y["policy_version_min"] == y["policy_version_max"] == k
    _assert_same_state(_final_state(col, 3), _final_state(dis, 3))


@pytest.mark.slow
def test_staleness_one_learns_within_the_bound(tmp_path: Path) -> None:
    """The rollout of step k + 1 overlaps the update of step k (the demo recipe, 8 steps, seeds 0 and 1): the
    reward rises on each seed and by 0.05 on average over them (measured: +0.037 and +0.094; the colocated
    trainer: +0.077 and +0.159), every step's samples are 0 or 1 update old, and from step 1 on exactly 1
    (version k - 1)."""
    gains = []
    with (_Background(tmp_path / "seed0", "--set", "steps=8", "--set", "seed=0", *ASYNC,
                      "--set", "async.max_staleness=1", nproc=2) as seed0,
          _Background(tmp_path / "seed1", "--set", "steps=8", "--set", "seed=1", *ASYNC,
                      "--set", "async.max_staleness=1", nproc=2) as seed1):
        done = [seed0.result(), seed1.result()]
    for seed, p in enumerate(done):
        run = tmp_path / f"seed{seed}"
        assert p.returncode == 0, p.stderr[-3000:]
        r = _rewards(run)
        print(f"staleness 1, seed {seed}: reward per step", [f"{x:.3f}" for x in r])
        gains.append(reward_gain(r))
        for k, m in enumerate(_metrics(run)):
            assert m["policy_version_min"] == m["policy_version_max"] == max(0, k - 1), (k, m)
            assert m["staleness_0"] + m["staleness_1"] == 1.0
            assert m["staleness_1"] == (1.0 if k >= 1 else 0.0)
    assert min(gains) > 0.01 and sum(gains) / 2 > 0.05, gains


@pytest.mark.slow
def test_a_killed_rollout_rank_stops_the_trainer_naming_rank_and_step(tmp_path: Path) -> None:
    """Both ranks started as torchrun would (env://), the rollout rank SIGKILLed after the first step: the
    trainer exits 1 within the liveness bound with a message naming rollout rank 1 and the step. The bound is the
    default one: a killed rank's connection resets at once (the trainer reads it in under a second), and a shorter
    bound fired during the start-up of a loaded machine (two test workers on two cores)."""
    run, bound = tmp_path / "killed", 60.0
    procs = _start_ranks(run, "--set", "steps=6", *ASYNC, "--set", "async.max_staleness=1",
                         "--set", f"async.liveness_timeout_s={bound}")
    trainer, rollout = procs
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            if trainer.poll() is not None or time.monotonic() > deadline:
                _kill_all(procs)
                raise AssertionError(f"the run never finished a step: {trainer.communicate()[1][-3000:]}")
            time.sleep(0.05)
        rollout.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = trainer.communicate(timeout=bound + 60)
        waited = time.monotonic() - killed
    finally:
        _kill_all(procs)
    print(f"trainer exited {trainer.returncode} {waited:.1f} s after the kill:", err.strip().splitlines()[-1])
    assert trainer.returncode == 1, err[-3000:]
    assert "rollout error: rollout rank 1 lost while step" in err, err[-3000:]
    assert waited < bound + 30, waited


# Staleness 1, checkpoints after steps 2 and 4, a held-out evaluation every 2 steps (sampled by the trainer's own
# engine copy).
RESUMABLE = ["--set", "steps=5", *ASYNC, "--set", "checkpoint.every=2", "--set", "checkpoint.keep=5",
             "--set", "async.max_staleness=1", "--set", 'eval.prompts=["a red circle","a blue square"]',
             "--set", "eval.seeds_per_prompt=1", "--set", "eval.num_steps=4", "--set", "eval.every=2"]


class _Reference:
    """A reference run started in the background (its tests start their own runs beside it) and awaited where a
    test first reads it."""

    def __init__(self, run: Path, background: _Background) -> None:
        self.run, self.background = run, background

    def path(self) -> Path:
        p = self.background.result()
        assert p.returncode == 0, p.stderr[-3000:]
        return self.run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Reference]:
    """The reference run of the resume tests (never modified)."""
    run = tmp_path_factory.mktemp("async") / "uninterrupted"
    with _Background(run, *RESUMABLE, nproc=2) as background:
        yield _Reference(run, background)


def _assert_resumed_equal(reference: _Reference, run: Path) -> None:
    """`run`, resumed with `--resume auto`, ends with the metrics, the evaluations and the final model and
    optimizer state of the reference, bit for bit, every step sampled with version k - 1."""
    resumed = _train(run, *RESUMABLE, "--resume", "auto", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    ref = reference.path()
    a, b = _metrics(ref), _metrics(run)
    assert len(a) == len(b) == 5
    for k, (x, y) in enumerate(zip(a, b)):
        same = {m: x[m] for m in x if not m.startswith(("time_", "images_per_s", "push_s"))}
        assert same == {m: y[m] for m in same}, f"step {k}"
        assert y["policy_version_min"] == y["policy_version_max"] == max(0, k - 1)
    evals = [[json.loads(line) for line in (r / "eval.jsonl").read_text().splitlines()] for r in (ref, run)]
    assert [e["step"] for e in evals[1]] == [0, 2, 4, 5]
    assert evals[0] == evals[1]
    _assert_same_state(_final_state(ref, 5), _final_state(run, 5))


@pytest.mark.slow
def test_sigkill_and_resume_equals_the_uninterrupted_run(uninterrupted: _Reference, tmp_path: Path) -> None:
    """Both ranks SIGKILLed once the step-2 checkpoint is complete (step 2, sampled ahead with version 1, is in it;
    the evaluation after step 2 is not recorded yet and is redone), then `--resume auto`: equal to the
    uninterrupted run, no step lost or sampled again with another version."""
    run = tmp_path / "killed"
    procs = _start_ranks(run, *RESUMABLE)
    marker = run / "checkpoints" / "step_000002" / "COMPLETE"
    try:
        _wait_until(marker.exists, procs, "no step-2 checkpoint")
    finally:
        _kill_all(procs)
    _assert_resumed_equal(uninterrupted, run)


@pytest.mark.slow
def test_sigterm_stops_every_rank_with_the_stop_status_and_saves_the_step_ahead(tmp_path: Path) -> None:
    """SIGTERM to both ranks (as torchrun forwards it) after the first step: the step finishes, the checkpoint is
    written with the step sampled ahead in it (what a resume trains on: the SIGKILL test resumes from such a
    checkpoint), and the trainer and the rollout rank both exit 5."""
    run = tmp_path / "stopped"
    procs = _start_ranks(run, *RESUMABLE)
    try:
        _wait_until(lambda: (run / "metrics.jsonl").exists() and bool((run / "metrics.jsonl").read_text().strip()),
                    procs, "no step finished")
        for q in procs:
            q.send_signal(signal.SIGTERM)
        outs = [q.communicate(timeout=300) for q in procs]
    finally:
        _kill_all(procs)
    for q, (_, err) in zip(procs, outs):
        assert q.returncode == 5, err[-3000:]
        assert "stopped by SIGTERM after step" in err, err[-3000:]
    from megatron_omni.trainer.checkpointing import read_common

    done = int(re.search(r"stopped by SIGTERM after step (\d+)", outs[0][1]).group(1))
    assert read_common(run / "checkpoints" / f"step_{done:06d}")["data"]["in_flight"] == [done]


@pytest.mark.slow
def test_a_resume_with_a_smaller_bound_samples_the_saved_steps_again(uninterrupted: _Reference,
                                                                    tmp_path: Path) -> None:
    """The staleness-1 run's step-2 checkpoint (step 2 saved, sampled with version 1) resumed with
    `async.max_staleness=0`: that step is sampled again with version 2 (said on the console), and every later step
    is on-policy."""
    run = tmp_path / "smaller_bound"
    shutil.copytree(uninterrupted.path(), run)
    for late in ("step_000004", "step_000005"):
        shutil.rmtree(run / "checkpoints" / late)
    p = _train(run, *RESUMABLE, "--set", "async.max_staleness=0", "--resume", "auto", nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the checkpoint's steps [2] were sampled with older policy versions" in p.stdout + p.stderr
    m = _metrics(run)
    assert [x["policy_version_max"] for x in m] == [0, 0, 2, 3, 4]
    assert [x["policy_version_min"] for x in m] == [0, 0, 2, 3, 4]


# The two-trainer-rank layouts: (the layout's keys, whether its test resumes it), in the tests' order.
LAYOUTS = {"dp2": (["parallel.tp=1"], True), "tp2-lora": (["parallel.tp=2", "model.lora.rank=4"], False),
           "pp2": (["parallel.pp=2", "optim.micro_batch_size=4"], False)}


def _layout_args(name: str) -> list[str]:
    return ["--set", "steps=4", *ASYNC, *[a for kv in LAYOUTS[name][0] for a in ("--set", kv)],
            "--set", "async.max_staleness=1", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=5"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Each layout's 4-step run (never modified; the dp2 test resumes a copy), two at a time: asking for one
    starts it and the next layout's, so each test's run overlaps the next test's."""
    root = tmp_path_factory.mktemp("layouts")
    started: dict[str, _Background] = {}

    def start(name: str) -> _Background:
        if name not in started:
            started[name] = _Background(root / name, *_layout_args(name), nproc=3)
        return started[name]

    def run(name: str) -> Path:
        background = start(name)
        order = list(LAYOUTS)
        if order.index(name) + 1 < len(order):
            start(order[order.index(name) + 1])
        p = background.result()
        assert p.returncode == 0, p.stderr[-3000:]
        return root / name

    try:
        yield run
    finally:
        for background in started.values():
            background.__exit__()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_two_trainer_ranks_train_and_resume_equal(name: str, layout_runs: Callable[[str], Path],
                                                  uninterrupted: _Reference, tmp_path: Path) -> None:
    """Two trainer ranks (data parallel 2, tensor parallel 2 training LoRA adapters: the push merges them into
    full weights, or pipeline parallel 2: each stage's first rank pushes its blocks) and one rollout rank,
    staleness 1: the root asks for whole steps and scatters each
    data-parallel share, so step 0 (version 0) scores the same samples as the one-trainer-rank run (its reward
    figures equal up to the order of the float sum); every step's versions are k - 1 (each swap passed the probe
    check). dp2 (the in-flight count told to every trainer rank, the push after the resume): a resume from the
    step-2 checkpoint (the later one removed, as a job killed after it would leave) ends with the
    uninterrupted run's metrics and model and optimizer state, bit for bit."""
    args, resume = _layout_args(name), LAYOUTS[name][1]
    ref = layout_runs(name)
    m = _metrics(ref)
    one = _metrics(uninterrupted.path())[0]
    assert m[0]["reward_mean"] == pytest.approx(one["reward_mean"], abs=1e-6)
    assert m[0]["reward_std"] == pytest.approx(one["reward_std"], abs=1e-6)
    assert [x["policy_version_max"] for x in m] == [x["policy_version_min"] for x in m] == [0, 0, 1, 2]
    if not resume:
        return
    run = tmp_path / "resumed"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    resumed = _train(run, *args, "--resume", "auto", nproc=3)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for k, (x, y) in enumerate(zip(m, _metrics(run), strict=True)):
        same = {n: x[n] for n in x if not n.startswith(("time_", "images_per_s", "push_s"))}
        assert same == {n: y[n] for n in same}, f"step {k}"
    _assert_same_state(_final_state(ref, 4), _final_state(run, 4))


@pytest.mark.slow
def test_fp8_rollout_ranks_sample_quantized_and_pass_every_swap_probe(uninterrupted: _Reference,
                                                                     tmp_path: Path) -> None:
    """`rollout.quantization=fp8` on the rollout rank (staleness 1, `algorithm.is_cap=2`): each swap re-quantizes
    the weights swapped in and passes the quantized probe check (the run fails otherwise); step 0 samples quantized:
    its reward differs from the unquantized run's by little, and the behaviour/trainer gap is > 0 where the
    unquantized run's is 0."""
    run = tmp_path / "fp8"
    p = _train(run, "--set", "steps=4", *ASYNC, "--set", "async.max_staleness=1", "--set", "rollout.quantization=fp8",
               "--set", "algorithm.is_cap=2", nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    m, plain = _metrics(run), _metrics(uninterrupted.path())[0]
    assert m[0]["reward_mean"] != plain["reward_mean"] and abs(m[0]["reward_mean"] - plain["reward_mean"]) < 0.05
    assert plain["behaviour_dlogp"] == 0 and all(x["behaviour_dlogp"] > 0 for x in m), m
    assert [x["policy_version_max"] for x in m] == [x["policy_version_min"] for x in m] == [0, 0, 1, 2]


# The rollout rank owns vLLM-Omni's `Omni` engine (our CPU platform plugin, one worker process); staleness 1, a
# checkpoint after steps 2 and 4.
VLLM_ASYNC = ["--set", "steps=4", *ASYNC, "--set", "rollout.engine=vllm_omni", "--set", "async.max_staleness=1",
              "--set", "checkpoint.every=2", "--set", "checkpoint.keep=5"]
# The same at rollout tp 2: 1 trainer + 2 rollout ranks, one rollout group: rank 1 owns the engine (two worker
# processes, on the group's two GPUs on a GPU machine), rank 2 starts nothing and joins the job's collectives.
VLLM_ASYNC_TP2 = [*VLLM_ASYNC, "--set", "placement.rollout_ranks=2", "--set", "rollout.tp=2"]


# The reward gain (mean of the last two steps minus the first two) the vLLM-Omni run must beat.
REWARD_GAIN = 0.02  # measured: +0.040 (rewards -2.338, -2.315, -2.283, -2.290; the fifth step -2.283)


def _engine_processes(rank_pid: int) -> list:
    """The processes of the `Omni` engine a rollout rank owns: its descendants (the stage process and the worker)."""
    import psutil

    return psutil.Process(rank_pid).children(recursive=True)


@pytest.mark.slow
def test_vllm_omni_rollout_ranks_learn_report_engine_failure_and_resume_equal(tmp_path: Path) -> None:
    """`rollout.engine=vllm_omni` disaggregated at rollout tp 2 (1 trainer + 2 rollout ranks: one rollout group,
    rank 1 owning an `Omni` engine with two worker processes, rank 2 holding its GPU for them): every push goes
    over `collective_rpc` into the back buffer in both workers, swapped in between two requests with the probe
    (one line at the end counts the swaps, each probe passed or the run fails); the reward rises over the 4 steps
    and every step's versions are max(0, k - 1). Beside it, 3 steps at rollout tp 1 (1 + 1 ranks) with
    `rollout.quantization=fp8` (vLLM's FP8 linears in the worker; its back copy quantized at each swap,
    `QuantizedBackBuffer`): every swap passes the quantized probe, step 0 samples quantized (its reward near the
    unquantized run's, not equal; the behaviour / trainer gap > 0 on every step). A second tp-2 run (overlapping the
    first): once its step-2 checkpoint is complete the engine's processes on the owner are SIGKILLed: the trainer
    exits 1 with a message naming rollout rank 1 and the engine's failure. Every rank killed, a `--resume auto`
    whose owner's engine cannot start (vLLM's logging config missing on that rank only) ends with the trainer's
    exit 1 naming that cause (`EngineStartError`), not the transport error of its first push, the group's other
    rank naming its owner's failure, nothing written; then `--resume auto` ends equal to the uninterrupted run bit
    for bit."""
    ref, fp8 = tmp_path / "uninterrupted", tmp_path / "fp8"
    fp8_args = ["--set", "steps=3", *ASYNC, "--set", "rollout.engine=vllm_omni", "--set", "async.max_staleness=1",
                "--set", "rollout.quantization=fp8", "--set", "algorithm.is_cap=2"]
    with (_Background(ref, *VLLM_ASYNC_TP2, nproc=3) as uninterrupted,
          _Background(fp8, *fp8_args, nproc=2) as quantized):
        run = tmp_path / "killed"
        procs = _start_ranks(run, *VLLM_ASYNC_TP2, world=3)
        trainer, rollout, _ = procs
        marker = run / "checkpoints" / "step_000002" / "COMPLETE"
        try:
            deadline = time.monotonic() + 600
            while not marker.exists():
                assert all(q.poll() is None for q in procs) and time.monotonic() < deadline, "no step-2 checkpoint"
                time.sleep(0.02)
            engine = _engine_processes(zygote.real_pid(rollout.pid))
            assert engine, "the rollout rank runs no engine process"
            for q in engine:
                q.kill()
            killed = time.monotonic()
            _, err = trainer.communicate(timeout=300)
            waited = time.monotonic() - killed
        finally:
            _kill_all(procs)
        print(f"engine killed: the trainer exited {trainer.returncode} after {waited:.1f} s:",
              [line for line in err.splitlines() if "rollout error" in line])
        assert trainer.returncode == 1, err[-3000:]
        assert "rollout error: rollout rank 1 failed serving step" in err, err[-3000:]
        assert not (run / "checkpoints" / "step_000004").exists()

        _resume_with_an_engine_that_cannot_start(run, tmp_path / "missing-logging.json")
        resumed = _train(run, *VLLM_ASYNC_TP2, "--resume", "auto", nproc=3)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from" in resumed.stdout + resumed.stderr
        p, q = uninterrupted.result(), quantized.result()
    assert p.returncode == 0, p.stderr[-3000:]
    # 4 steps at staleness 1: versions 0, 0, 1, 2 are sampled, so 2 pushes are swapped in.
    swaps = _swaps(p.stdout + p.stderr)
    assert swaps and swaps.group(1) == "4" and swaps.group(2) == "2", (p.stdout + p.stderr)[-3000:]
    assert float(swaps.group(3)) < 1e-4  # fp32 on both sides (probe.TOLERANCES)
    assert "rollout rank 2:" not in p.stdout + p.stderr  # the group's other rank serves nothing
    m = _metrics(ref)
    r = [x["reward_mean"] for x in m]
    print("vllm_omni disaggregated rollout tp 2, staleness 1: reward per step", [f"{x:.3f}" for x in r],
          "swap probe", swaps[3])
    assert reward_gain(r) > REWARD_GAIN, r
    assert [x["policy_version_min"] for x in m] == [x["policy_version_max"] for x in m] == [0, 0, 1, 2]
    for k, (x, y) in enumerate(zip(m, _metrics(run), strict=True)):
        same = {n: x[n] for n in x if not n.startswith(("time_", "images_per_s", "push_s"))}
        assert same == {n: y[n] for n in same}, f"step {k}"
    _assert_same_state(_final_state(ref, 4), _final_state(run, 4))

    assert q.returncode == 0, q.stderr[-3000:]
    swaps = _swaps(q.stdout + q.stderr)  # versions 0, 0, 1: one swap, its quantized probe passed
    assert swaps and swaps.group(1) == "3" and swaps.group(2) == "1", (q.stdout + q.stderr)[-3000:]
    quant = _metrics(fp8)
    print("vllm_omni fp8 disaggregated: reward per step", [f"{x['reward_mean']:.4f}" for x in quant],
          "behaviour dlogp", [f"{x['behaviour_dlogp']:.2e}" for x in quant], "unquantized step 0",
          f"{m[0]['behaviour_dlogp']:.2e}", "swap probe", swaps[3])
    assert quant[0]["reward_mean"] != m[0]["reward_mean"] and abs(quant[0]["reward_mean"] - m[0]["reward_mean"]) < 0.05
    # the unquantized engine differs from the trainer by its GEMMs only (fp32): the FP8 gap is far larger
    assert all(x["behaviour_dlogp"] > 10 * m[0]["behaviour_dlogp"] for x in quant), (m[0]["behaviour_dlogp"], quant)
    assert [x["policy_version_max"] for x in quant] == [x["policy_version_min"] for x in quant] == [0, 0, 1]


def _swaps(out: str) -> re.Match | None:
    """The trainer's closing line on the rollout rank: (requests, swaps, the largest probe difference)."""
    return re.search(r"rollout rank 1: (\d+) requests, (\d+) swaps, every swap's probe passed \(max \|diff\| (\S+)\)",
                     out)


def _resume_with_an_engine_that_cannot_start(run: Path, missing: Path) -> None:
    """`--resume auto` of `run` with the rollout rank's engine failing to start (vLLM refuses a logging config that
    does not exist: set on the rollout rank only): the trainer's first act is the push of the loaded version, which
    the rollout rank cannot join; the trainer exits 1 naming the rank and the engine's cause, the rollout rank too,
    and the run folder keeps its checkpoints and metrics."""
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    procs = _start_ranks(run, *VLLM_ASYNC_TP2, "--resume", "auto", world=3,
                         rank_env={1: {"VLLM_LOGGING_CONFIG_PATH": str(missing)}})
    try:
        outs = [q.communicate(timeout=300)[1] for q in procs]
    finally:
        _kill_all(procs)
    trainer, rollout, member = outs
    print("resumed with an engine that cannot start:", [x for x in trainer.splitlines() if "rollout" in x][-2:])
    assert [q.returncode for q in procs] == [1, 1, 1], (trainer[-2000:], rollout[-2000:], member[-2000:])
    assert ("rollout error: rollout rank 1 failed before serving any step:\n(the engine owner of rollout rank 2's "
            "group) EngineStartError: vLLM-Omni engine for") in member, member[-3000:]
    cause = "EngineStartError: vLLM-Omni engine for"
    assert ("rollout error: rollout rank 1 failed before serving any step:\nrollout.engine='vllm_omni' failed to "
            f"start on rollout rank 1: {cause}") in trainer, trainer[-3000:]
    assert f"Could not load logging config. File does not exist: %s', '{missing}'" in trainer, trainer[-3000:]
    assert "rollout engine error: vLLM-Omni engine for" in rollout, rollout[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
