"""The GPU image's install plan keeps one torch (no Docker here: pip resolves the plan from PyPI).

The Dockerfile installs torch/torchvision/torchaudio first, pins them with docker/constraints.txt as
PIP_CONSTRAINT, then installs this project with its `gpu` extra (vLLM, vLLM-Omni, ModelOpt) and compiles
TransformerEngine and apex against that torch without build isolation. Here `pip install --dry-run --report`
resolves `.[gpu]` under the same constraints file, ignoring what this venv has: it fails if any pinned
package needs another torch, and the plan must hold exactly the constrained versions (vllm==0.30.0 requires
them). This machine resolves for its own CPython (3.11, x86_64 Linux; the image runs 3.12): pip cannot
resolve cross-platform here because vLLM-Omni needs openai-whisper, which ships no wheel.

The resolve is one single-threaded process (about a minute of CPU, but two to four minutes of wall: pip downloads
about 2 GB of wheels to read their metadata, since the index serves no PEP 658 metadata and no cache headers) that
depends on nothing the suite does, so it starts at the end of collection (tests/e2e/conftest.py calls `start_plan`),
niced: it uses the core time the tests before it leave idle, and the test waits for its result. Under pytest-xdist
(`make test`) the first worker to finish collecting starts it in a folder named by the test run's id; the test, in
whichever worker runs it, waits for the exit status the resolve writes there.
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
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
TIMEOUT_S = 1200
# The resolve started early: its process and folder (report.json, stdout.txt, stderr.txt).
_PLAN: dict = {}


def _shared_folder() -> Path | None:
    """Under pytest-xdist: the folder every worker of this test run names alike (its run id); else None."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"gpu-install-plan-{uid}" if uid else None


def start_plan() -> None:
    """Start `pip install --dry-run --report` of the image's plan in a temp folder at low priority (mostly the core
    time other processes leave; its test raises it back when it waits), unless it already runs (in this process or,
    under pytest-xdist, in another worker of the same test run: the folder's atomic creation decides which starts
    it). Output goes to files, not pipes (a full pipe would stall pip while the suite runs other tests); the exit
    status goes to `rc` in the folder when pip ends, `pid` names the process group."""
    if _PLAN:
        return
    shared = _shared_folder()
    if shared is None:
        folder = Path(tempfile.mkdtemp(prefix="gpu-install-plan-"))
    else:
        try:
            shared.mkdir()
        except FileExistsError:  # another worker started it: the test waits on its folder
            _PLAN.update(folder=shared, owner=False)
            return
        folder = shared
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(folder / "report.json"), "-c", str(CONSTRAINTS), f"{ROOT}[gpu]"]
    # sh writes pip's exit status where a process of another worker can read it (rc.part, renamed when whole)
    wrapped = ["sh", "-c", '"$@"; echo $? > rc.part && mv rc.part rc', "sh", *cmd]
    with (folder / "stdout.txt").open("w") as out, (folder / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(wrapped, cwd=folder, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    (folder / "pid").write_text(str(proc.pid))
    _PLAN.update(folder=folder, proc=proc, owner=True)
    _priority(proc.pid, 10)


def _priority(pgid: int, nice: int) -> None:
    """Set the nice value of the resolve's process group and of its session's scheduling group: with autogroup
    scheduling (Linux's default) a process's own nice only ranks it inside its session, and pip has its own.
    Raising the priority back needs the privilege to (root has it); without it, it stays low."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    with contextlib.suppress(OSError):
        Path(f"/proc/{pgid}/autogroup").write_text(str(nice))


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(folder: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int((folder / "pid").read_text()), 9)


def stop_plan(session_failed: bool = True) -> None:
    """At a session's end: kill the resolve if it still runs and remove its folder. Under pytest-xdist the worker
    that started it leaves it to the worker whose test waits on it, unless the test run stops early
    (`session_failed`: a failure under -x, an interrupt) or the test has read it already."""
    if not _PLAN:
        return
    folder, proc = _PLAN["folder"], _PLAN.get("proc")
    if _PLAN.get("owner") and (proc is None or _shared_folder() is None or session_failed
                               or not folder.exists()):
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 9)
        if proc is not None:
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
    _PLAN.clear()


def _wait_for_plan(folder: Path, timeout_s: float) -> int:
    """pip's exit status, once `rc` appears in `folder`; kills the resolve past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (folder / "rc").exists():
        pid = (folder / "pid").read_text() if (folder / "pid").exists() else ""
        if pid and not _alive(int(pid)) and not (folder / "rc").exists():
            raise RuntimeError(f"the install plan's resolve (process group {pid}) ended without an exit status")
        if time.monotonic() > deadline:
            _kill(folder)  # no rc yet: its process group still runs
            raise subprocess.TimeoutExpired("pip install --dry-run", timeout_s)
        time.sleep(0.5)
    return int((folder / "rc").read_text())


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
    folder = _PLAN["folder"]
    while not (folder / "pid").exists():  # another worker has just created the folder and is starting it
        time.sleep(0.1)
    # nothing of the suite runs while it waits; on a shared machine niced pip would crawl
    _priority(int((folder / "pid").read_text()), 0)
    try:
        returncode = _wait_for_plan(folder, TIMEOUT_S)
        stderr = (folder / "stderr.txt").read_text()
        assert returncode == 0, f"the image's install plan does not resolve under {CONSTRAINTS.name}:\n" \
                                f"{stderr[-4000:]}"
        plan = json.loads((folder / "report.json").read_text())["install"]
    finally:
        if _PLAN.get("owner"):
            stop_plan()
        else:
            if not (folder / "rc").exists():  # a failure before the resolve ended
                _kill(folder)
            shutil.rmtree(folder, ignore_errors=True)
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in plan}
    for name, version in _pins(CONSTRAINTS).items():
        assert name in planned, f"{name} is not in the plan"
        assert planned[name].split("+")[0] == version, f"{name}: plan has {planned[name]}, image pins {version}"
    for name, version in (("vllm", "0.30.0"), ("vllm-omni", "0.30.0"), ("megatron-core", "0.16.1")):
        assert planned.get(name) == version, (name, planned.get(name))
