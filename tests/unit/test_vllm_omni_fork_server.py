"""The CPU engine's workers fork from a multiprocessing fork server (`cpu_worker.worker_context`): a worker must end
with the process that launched it, as a spawned one did. A launcher here is a plain script that forks one child
through the fork server as our executor does, the child asking for SIGTERM at its parent's exit as vLLM-Omni's
worker does (`set_death_signal`), with or without `plugin.release_fork_server` first; then the launcher is
SIGKILLed (a rank that died). No vLLM import: the mechanism is multiprocessing's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.processes import alive, fork_servers

LAUNCHER = '''
import ctypes, multiprocessing, os, signal, sys, time
from pathlib import Path

from megatron_omni.rollout.vllm_omni.plugin import release_fork_server


def child(path, release):
    if release:
        release_fork_server()
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, as vLLM-Omni's worker
    Path(path + ".tmp").write_text(str(os.getpid()))
    os.rename(path + ".tmp", path)
    time.sleep(120)


if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([])
    process = context.Process(target=child, args=(sys.argv[1], sys.argv[2] == "release"))
    process.start()
    time.sleep(120)
'''


def test_a_forked_worker_ends_with_the_process_that_launched_it(tmp_path: Path) -> None:
    """Released, the server and its child are gone within seconds of the launcher's SIGKILL; without the release
    (multiprocessing's default: every child of the server holds the server's "alive" pipe) both outlive it: the
    child keeps its parent, the server, alive, so its death signal never fires. (Both launchers run at once.)"""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    cases = {"release": tmp_path / "released.pid", "keep": tmp_path / "kept.pid"}
    launchers = {case: subprocess.Popen([sys.executable, str(script), str(marker), case],
                                        cwd=Path(__file__).resolve().parents[2]) for case, marker in cases.items()}
    started: dict[str, tuple[int, int]] = {}  # case -> (its fork server, the child)
    try:
        deadline = time.monotonic() + 120
        while len(started) < len(cases):
            for case, marker in cases.items():
                if case not in started and marker.exists():
                    servers = fork_servers(launchers[case].pid)
                    child = int(marker.read_text())
                    assert len(servers) == 1 and psutil.Process(child).ppid() == servers[0], (case, servers, child)
                    started[case] = (servers[0], child)
            assert all(q.poll() is None for q in launchers.values()) and time.monotonic() < deadline, started
            time.sleep(0.05)
        for launcher in launchers.values():
            launcher.kill()
            launcher.wait()
        killed = time.monotonic()
        while any(map(alive, started["release"])) and time.monotonic() < killed + 15:
            time.sleep(0.05)
        gone = time.monotonic() - killed
        time.sleep(max(0.0, 2.0 - gone))  # the kept pair, 2 s on at least
        running = {case: tuple(map(alive, pids)) for case, pids in started.items()}
        print(f"released pair gone {gone:.1f} s after the launchers' SIGKILL; (server, child) alive "
              f"{time.monotonic() - killed:.1f} s after it: {running}")
        assert running == {"release": (False, False), "keep": (True, True)}
    finally:
        for pid in [*(q.pid for q in launchers.values()), *(p for pids in started.values() for p in pids)]:
            if alive(pid):
                psutil.Process(pid).kill()
