"""Multi-node for real, on one machine: the tiny recipe launched as 2 nodes x 1 rank through the cluster launch
machinery (examples/tiny/train_tiny.sh: two torchrun agents with --nnodes 2 rendezvousing over loopback, node 0
starting the reward server as its own process and node 1 waiting for it), a few FlowGRPO steps, then the same
global layout (dp=2) as one node x 2 ranks. Rewards, every logged metric and the final weights must match.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel.rank_pool import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/tiny/train_tiny.sh"
STEPS = 2
SMALL = ["--set", f"steps={STEPS}", "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
         "--set", "rollout.num_steps=4", "--set", "rollout.height=32", "--set", "rollout.width=32",
         "--set", "logging.tensorboard=false", "--set", "logging.image_every=0"]
TIMEOUT_S = 600
TIMING = ("time_", "images_per_s")  # wall-clock metrics differ between runs by nature


def _start(run_dir: Path, **knobs: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REWARD_", "NNODES", "NODE_RANK", "WORLD_SIZE"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHON=sys.executable, RUN_DIR=str(run_dir), **knobs)
    log = open(run_dir.parent / f"{run_dir.name}-node{knobs.get('NODE_RANK', '0')}.log", "w")
    # Own session: a hang is killed with everything the script started (torchrun, ranks, reward server).
    return subprocess.Popen(["bash", SCRIPT, *SMALL], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"launch did not finish within {TIMEOUT_S} s:\n" + "\n".join(x.read_text()[-2000:] for x in logs))
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"{log.name} exited {p.returncode}:\n{log.read_text()[-4000:]}"


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the final checkpoint (a Megatron distributed checkpoint: model weights and optimizer
    state under global names), read whole in this process."""
    from megatron_omni.checkpoint.streaming import checkpoint_tensor_specs, load_full_tensors, single_process_group

    folder = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    assert (folder / "COMPLETE").exists(), f"no complete final checkpoint in {folder}"
    with single_process_group():
        specs = checkpoint_tensor_specs(folder)
        (tensors,) = load_full_tensors(folder, [sorted(specs)], specs)
    return tensors


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_two_nodes_match_one_node(tmp_path: Path) -> None:
    multi, single = tmp_path / "two_nodes", tmp_path / "one_node"
    multi.mkdir()
    single.mkdir()
    master, reward = free_port(), free_port()
    # A multi-node run needs one reward-server token shared by every node (the launch refuses without one).
    common = dict(NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                  REWARD_SERVER="1", REWARD_PORT=str(reward), REWARD_SERVER_TOKEN="multinode-test-token")
    procs = [_start(multi, NODE_RANK=str(i), **common) for i in (0, 1)]
    # The reference, same global layout (dp=2) on one node, scoring in the trainer (no server): runs meanwhile.
    procs.append(_start(single, NNODES="1", NPROC_PER_NODE="2", NODE_RANK="0", MASTER_PORT=str(free_port()),
                        REWARD_SERVER="0"))
    logs = [tmp_path / "two_nodes-node0.log", tmp_path / "two_nodes-node1.log", tmp_path / "one_node-node0.log"]
    _wait_all(procs, logs)

    node0, node1 = logs[0].read_text(), logs[1].read_text()
    assert "2 node(s) x 1 trainer ranks = world size 2" in node0 and "node rank 1" in node1
    assert "reward server (pid" in node0 and "reward server (pid" not in node1  # only node 0 starts it
    assert f"http://127.0.0.1:{reward}/health is healthy" in node1
    assert json.loads((multi / "config.json").read_text())["reward"]["url"] == f"http://127.0.0.1:{reward}"
    assert json.loads((single / "config.json").read_text())["reward"]["url"] is None
    assert _port_closed(reward), "the launch script left its reward server running"

    a, b = _metrics(multi), _metrics(single)
    documented = (ROOT / "docs" / "metrics.md").read_text()
    assert not [k for k in a[0] if f"`{k}`" not in documented], "metric keys missing from docs/metrics.md"
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(STEPS))
    for ma, mb in zip(a, b):
        keys = {k for k in ma if not k.startswith(TIMING)}
        assert keys == {k for k in mb if not k.startswith(TIMING)}
        for k in sorted(keys):
            assert ma[k] == pytest.approx(mb[k], abs=1e-6, rel=0), f"step {ma['step']} {k}: {ma[k]} vs {mb[k]}"
    wa, wb = _final_tensors(multi), _final_tensors(single)
    assert wa.keys() == wb.keys() and any("weight" in k for k in wa), sorted(wa)[:5]
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"final {k}: {m}")
