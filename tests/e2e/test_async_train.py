"""The asynchronous trainer end to end (`placement.mode=disaggregated`, docs/async.md), as users run it: one
trainer rank and one rollout rank under torchrun. Staleness 0 is the synchronous colocated trainer bit for bit;
staleness 1 learns, with every trajectory's policy version within the bound; a killed rollout rank stops the
trainer with its rank and step named, within the liveness bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_omni.parallel.rank_pool import free_port
from tests.e2e.test_flowgrpo_train import ROOT, SHORT, _assert_same_state, _env, _final_state, _rewards, _train

# One trainer rank + one rollout rank; checkpoints only at the end (the in-flight step is not checkpointed yet).
ASYNC = ["--set", "placement.mode=disaggregated", "--set", "placement.rollout_ranks=1", "--set", "checkpoint.every=0"]
# The metrics that depend on timing or exist on one side only (the colocated sync's probe is the rollout rank's
# swap probe here, checked there).
NOT_COMPARABLE = ("time_", "images_per_s", "staleness_", "policy_version_", "push_s", "behaviour_dlogp",
                  "sync_probe")


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_staleness_zero_equals_the_synchronous_colocated_trainer(tmp_path: Path) -> None:
    """max_staleness=0 through the rollout service (gloo transport, back buffer, swap, probe) gives the metrics
    and the final model and optimizer state of the colocated trainer whose engine samples with its own copy."""
    steps = ["--set", "steps=3", "--set", "checkpoint.every=0", "--set", "rollout.transformer=engine"]
    col, dis = tmp_path / "colocated", tmp_path / "disaggregated"
    p = _train(col, *steps)
    assert p.returncode == 0, p.stderr[-3000:]
    p = _train(dis, *steps, *ASYNC, nproc=2)
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
    for seed in (0, 1):
        run = tmp_path / f"seed{seed}"
        p = _train(run, "--set", "steps=8", "--set", f"seed={seed}", *ASYNC, "--set", "async.max_staleness=1",
                   nproc=2)
        assert p.returncode == 0, p.stderr[-3000:]
        r = _rewards(run)
        print(f"staleness 1, seed {seed}: reward per step", [f"{x:.3f}" for x in r])
        gains.append(sum(r[-2:]) / 2 - sum(r[:2]) / 2)
        for k, m in enumerate(_metrics(run)):
            assert m["policy_version_min"] == m["policy_version_max"] == max(0, k - 1), (k, m)
            assert m["staleness_0"] + m["staleness_1"] == 1.0
            assert m["staleness_1"] == (1.0 if k >= 1 else 0.0)
    assert min(gains) > 0.01 and sum(gains) / 2 > 0.05, gains


@pytest.mark.slow
def test_a_killed_rollout_rank_stops_the_trainer_naming_rank_and_step(tmp_path: Path) -> None:
    """Both ranks started as torchrun would (env://), the rollout rank SIGKILLed after the first step: the
    trainer exits 1 within the liveness bound with a message naming rollout rank 1 and the step."""
    run, port, bound = tmp_path / "killed", free_port(), 20.0
    cmd = [sys.executable, "-m", "megatron_omni.train", "--set", f"run_dir={run}", *SHORT, "--set", "steps=6",
           *ASYNC, "--set", "async.max_staleness=1", "--set", f"async.liveness_timeout_s={bound}"]
    procs = []
    for rank in (0, 1):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    trainer, rollout = procs
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert trainer.poll() is None and time.monotonic() < deadline, "the run never finished a step"
            time.sleep(0.05)
        rollout.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = trainer.communicate(timeout=bound + 60)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    print(f"trainer exited {trainer.returncode} {waited:.1f} s after the kill:", err.strip().splitlines()[-1])
    assert trainer.returncode == 1, err[-3000:]
    assert "rollout error: rollout rank 1 lost while step" in err, err[-3000:]
    assert waited < bound + 30, waited
