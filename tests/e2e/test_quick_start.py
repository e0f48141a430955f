"""docs/quick-start.md cannot rot: every CPU command of its sections 2 (train the tiny model on CPU) and 3 (plan a
20B job) runs as written, in a shell with the venv activated, but for short step counts and a small rollout
(`--set steps=4` becomes one step of 2 prompts x 2 samples, 4 sampling steps, 32 px), the run folders moved under
a temp folder and the fixed ports replaced by free ones. The two commands that are one `python -m
megatron_omni.train` (the one-process run and the planner's dry run) run as that command's `main` in this process,
in the shell's environment plus the command's own assignments (tests/e2e/in_process.py: no interpreter start
each). Section 1 (`make demo`, the OCR miniature: tests/e2e/test_ocr_miniature.py runs its recipe) and section 4
(cluster commands; their dry runs are tests/e2e/test_launch_scripts.py's) are not run here. A command added to
sections 2 or 3 fails the count below until this test runs it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_omni.parallel.rank_pool import free_port
from tests.e2e.in_process import call_main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quick-start.md"
SHORT = ("--set steps=1 --set rollout.prompts_per_step=2 --set rollout.group_size=2 --set rollout.num_steps=4 "
         "--set rollout.height=32 --set rollout.width=32 --set logging.tensorboard=false --set logging.image_every=0")
TIMEOUT_S = 600


def _commands(section: str) -> list[str]:
    """The command lines of the ```bash blocks of the page's section `## {section}.` (comments dropped)."""
    text = PAGE.read_text()
    body = re.search(rf"^## {section}\.(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", body, re.S)
             for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _shell(command: str, tmp: Path, ports: dict[str, int]) -> str:
    """The page's command as this test runs it (short steps, temp run folders, free ports)."""
    command = command.replace("--set steps=4", SHORT).replace("runs/", f"{tmp}/")
    for name, port in ports.items():
        command = re.sub(rf"\b{name}=\d+", f"{name}={port}", command)
    return command


def _env() -> dict[str, str]:
    venv = Path(sys.executable).parent  # `source .venv/bin/activate`: python and torchrun are the venv's
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("REWARD_", "NNODES", "NODE_RANK", "WORLD_SIZE", "MASTER_", "RUN_DIR"))}
    return {**env, "PATH": f"{venv}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv.parent),
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _start(command: str) -> subprocess.Popen:
    # A launch that names no MASTER_PORT gets a free one through the environment (the launch script's default,
    # 29500, would collide between the launches run at once here and with other torchrun jobs on the machine);
    # one that names it keeps its own (a free port already, _shell).
    env = _env()
    if "train_tiny.sh" in command and "MASTER_PORT=" not in command:
        env["MASTER_PORT"] = str(free_port())
    return subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


ENTRY = ["python", "-m", "megatron_omni.train"]


def _entry_point(command: str) -> tuple[dict[str, str], list[str]] | None:
    """(the variables the command line assigns, the entry point's arguments) when `command` is one
    `[VAR=value ...] python -m megatron_omni.train ARGS` (no shell syntax beyond that), else None."""
    words = shlex.split(command)
    assigned = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        assigned[name] = value
    if words[:3] != ENTRY or any(c in command for c in ";&|$`<>"):
        return None
    return assigned, words[3:]


def _in_process(command: str) -> subprocess.CompletedProcess:
    """The page's `python -m megatron_omni.train ...` command as its `main` in this process: the environment is
    the venv shell's plus what the command line assigns, as bash would give it, and torch's threads the number
    OMP_NUM_THREADS gives a new process (the run returns its status: nothing to exit)."""
    import torch

    from megatron_omni.train import main

    assigned, argv = _entry_point(command)
    env = {**_env(), **assigned}
    threads = torch.get_num_threads()
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        with contextlib.chdir(ROOT):  # where the page's commands run
            out = call_main(main, argv, env, args=shlex.split(command))
    finally:
        torch.set_num_threads(threads)
    assert out.returncode == 0, f"`{command}` exited {out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-4000:]}"
    return out


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill whatever of `procs` still runs (a failed assertion must not leave a launch behind)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()


def _finish(proc: subprocess.Popen, command: str) -> str:
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out = proc.communicate()[0]
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _one_step(run_dir: Path) -> None:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1, steps
    assert (run_dir / "config.json").exists() and (run_dir / "checkpoints" / "step_000001" / "COMPLETE").exists()


@pytest.mark.slow
def test_every_cpu_command_of_the_quick_start_runs(tmp_path: Path) -> None:
    train = _commands("2")
    plan = _commands("3")
    assert len(train) == 6 and len(plan) == 2, ("docs/quick-start.md's commands changed: run the new ones here",
                                                train, plan)
    assert train[3].startswith("export REWARD_SERVER_TOKEN="), train[3]  # both "terminals" of the two nodes
    token, train = train[3], train[:3] + [f"{train[3]}; {c}" for c in train[4:]]
    ports = {"REWARD_PORT": free_port(), "MASTER_PORT": free_port()}
    one, torchrun, server = (_shell(c, tmp_path, ports) for c in train[:3])
    plans = [_shell(c, tmp_path, {}) for c in plan]
    ports = {"REWARD_PORT": free_port(), "MASTER_PORT": free_port()}
    node0, node1 = (_shell(c, tmp_path, ports) for c in train[3:])
    # two "nodes" at once, as two terminals would; the token is generated once and exported in both
    secret = subprocess.run(["bash", "-c", f"{token}; echo $REWARD_SERVER_TOKEN"], env=_env(), capture_output=True,
                            text=True, check=True).stdout.strip()
    assert len(secret) == 32, secret
    node0, node1 = (c.replace(token, f"export REWARD_SERVER_TOKEN={secret}") for c in (node0, node1))
    # The commands are independent (own run folders, own free ports), so they run in two waves of about two
    # cores' worth each (the one-process run and the dry runs take one core each, OMP_NUM_THREADS=1) instead
    # of one after another: the suite's budget. Each is still checked as the page's command on its own.
    waves = [[(one, "qs-one"), (torchrun, "qs-torchrun"), *((c, None) for c in plans)],
             [(server, "qs-server"), (node0, "qs-2n"), (node1, None)]]
    assert _entry_point(one) is not None and _entry_point(plans[1]) is not None, (one, plans[1])
    assert all(_entry_point(c) is None for c in (torchrun, server, node0, node1, plans[0]))  # bash scripts
    for wave in waves:
        # the launches start first; the entry point's own commands run here meanwhile, one after the other
        procs = {command: _start(command) for command, _ in wave if _entry_point(command) is None}
        try:
            done = {command: _in_process(command).stdout for command, _ in wave if command not in procs}
            outs = [done[command] if command in done else _finish(procs[command], command) for command, _ in wave]
        finally:
            _stop(list(procs.values()))
        for (command, folder), out in zip(wave, outs):
            if folder is not None:
                _one_step(tmp_path / folder)
            elif command in plans:
                assert "images/s/GPU" in out, out[-3000:]
    assert (tmp_path / "qs-server" / "logs").is_dir()  # the reward server's output
