"""The GPU image's install plan keeps one torch (no Docker here: pip resolves the plan from PyPI).

The Dockerfile installs torch/torchvision/torchaudio first, pins them with docker/constraints.txt as
PIP_CONSTRAINT, then installs this project with its `gpu` extra (vLLM, vLLM-Omni, ModelOpt) and compiles
TransformerEngine and apex against that torch without build isolation. Here `pip install --dry-run --report`
resolves `.[gpu]` under the same constraints file, ignoring what this venv has: it fails if any pinned
package needs another torch, and the plan must hold exactly the constrained versions (vllm==0.30.0 requires
them). This machine resolves for its own CPython (3.11, x86_64 Linux; the image runs 3.12): pip cannot
resolve cross-platform here because vLLM-Omni needs openai-whisper, which ships no wheel.

The resolve is one single-threaded process (about a minute of CPU) that depends on nothing the suite does, so it
starts at the end of collection (tests/e2e/conftest.py calls `start_plan`), niced: it uses the core time the tests
before it leave idle, and the test waits for its result.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
TIMEOUT_S = 1200
# The resolve started early: its process and folder (report.json, stdout.txt, stderr.txt).
_PLAN: dict = {}


def start_plan() -> None:
    """Start `pip install --dry-run --report` of the image's plan in a temp folder at low priority (mostly the core
    time other processes leave; its test raises it back when it waits), unless it already runs. Output goes to
    files, not pipes (a full pipe would stall pip while the suite runs other tests)."""
    if _PLAN:
        return
    folder = Path(tempfile.mkdtemp(prefix="gpu-install-plan-"))
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(folder / "report.json"), "-c", str(CONSTRAINTS), f"{ROOT}[gpu]"]
    with (folder / "stdout.txt").open("w") as out, (folder / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=folder, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    _PLAN.update(folder=folder, proc=proc)
    _priority(proc.pid, 10)


def _priority(pid: int, nice: int) -> None:
    """Set the nice value of the resolve and of its session's scheduling group: with autogroup scheduling (Linux's
    default) a process's own nice only ranks it inside its session, and pip has its own. Raising the priority back
    needs the privilege to (root has it); without it, it stays low."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def stop_plan() -> None:
    """Kill the resolve if it still runs (a session that ends before its test) and remove its folder."""
    if not _PLAN:
        return
    proc = _PLAN["proc"]
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    shutil.rmtree(_PLAN["folder"], ignore_errors=True)
    _PLAN.clear()


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_dockerfile_installs_under_the_constraints() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY docker/constraints.txt /opt/megatron-omni/constraints.txt" in text
    assert "PIP_CONSTRAINT=/opt/megatron-omni/constraints.txt" in text
    assert 'pip install -e ".[gpu]"' in text
    pins = _pins(CONSTRAINTS)
    first = re.search(r'RUN pip install ("torch==[^\n]*)', text).group(1)
    assert first.rstrip(" \\").split() == [f'"{n}=={v}"' for n, v in pins.items()], first
    for step in ("transformer-engine[pytorch]", "APEX_CUDA_EXT=1"):  # compiled against the image's torch
        line = next(x for x in text.splitlines() if step in x and "pip install" in x)
        assert "--no-build-isolation" in line, line


@pytest.mark.slow
def test_gpu_install_plan_keeps_the_constrained_torch() -> None:
    start_plan()  # started at collection's end already, unless this test was not collected then
    folder, proc = _PLAN["folder"], _PLAN["proc"]
    _priority(proc.pid, 0)  # nothing of the suite runs while it waits; on a shared machine niced pip would crawl
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_plan()
        raise
    stderr = (folder / "stderr.txt").read_text()
    assert proc.returncode == 0, f"the image's install plan does not resolve under {CONSTRAINTS.name}:\n" \
                                 f"{stderr[-4000:]}"
    plan = json.loads((folder / "report.json").read_text())["install"]
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in plan}
    for name, version in _pins(CONSTRAINTS).items():
        assert name in planned, f"{name} is not in the plan"
        assert planned[name].split("+")[0] == version, f"{name}: plan has {planned[name]}, image pins {version}"
    for name, version in (("vllm", "0.30.0"), ("vllm-omni", "0.30.0"), ("megatron-core", "0.16.1")):
        assert planned.get(name) == version, (name, planned.get(name))
