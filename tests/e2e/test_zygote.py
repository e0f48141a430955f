"""The e2e suite's zygote (tests/e2e/zygote): a rank forked through its client behaves as the plain interpreter
would for what the e2e tests look at: arguments, working directory, environment and stdio; the exit status (an
uncaught exception's 1, a signal's death); signals sent to the client reach the rank; a SIGKILLed client takes the
rank with it; a request whose start-up environment differs runs in a plain interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import zygote
from tests.processes import alive

SCRIPT = '''
import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("ZYGOTE_TEST_VAR"), "pid", os.getpid(),
      "main", __name__, flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("the rank's own error")
if mode == "handler":
    signal.signal(signal.SIGTERM, lambda *_: (print("caught SIGTERM", flush=True), os._exit(5)))
    print("ready", flush=True)
    time.sleep(60)
if mode == "sleep":
    print("ready", flush=True)
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """A server preloading only `json` (the suite's preloads torch, megatron-core and diffusers), the script."""
    folder = tmp_path_factory.mktemp("zygote")
    script = folder / "rank.py"
    script.write_text(SCRIPT)
    env = {**zygote.rank_environment(), "ZYGOTE_TEST_VAR": "server"}
    proc, path = zygote.start_server(folder, env, preload=("json",))
    yield script, {**env, **zygote.client_environment(path)}
    proc.kill()
    proc.wait()


def _start(script: Path, env: dict[str, str], *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", str(zygote.CLIENT), str(script), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ready(proc: subprocess.Popen) -> str:
    out = ""
    while "ready" not in out:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        out += line
    return out


def test_a_forked_rank_has_the_requests_arguments_folder_environment_stdio_and_status(server, tmp_path) -> None:
    script, env = server
    proc = _start(script, {**env, "ZYGOTE_TEST_VAR": "request"}, "exit", "3", cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert f"argv ['exit', '3'] cwd {tmp_path} var request" in out and "main __main__" in out, out
    assert "to stderr" in err
    rank = int(out.split("pid ")[1].split()[0])
    assert rank != proc.pid  # forked by the server, not the client exec'ing an interpreter

    failed = _start(script, env, "raise", cwd=tmp_path)
    _, err = failed.communicate(timeout=60)
    assert failed.returncode == 1 and "ValueError: the rank's own error" in err and "Traceback" in err, err


def test_signals_reach_the_rank_and_its_death_is_the_clients(server, tmp_path) -> None:
    script, env = server
    handled = _start(script, env, "handler", cwd=tmp_path)
    _ready(handled)
    handled.send_signal(signal.SIGTERM)
    out, _ = handled.communicate(timeout=60)
    assert handled.returncode == 5 and "caught SIGTERM" in out

    killed = _start(script, env, "sleep", cwd=tmp_path)
    _ready(killed)
    killed.send_signal(signal.SIGTERM)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGTERM


def test_a_sigkilled_client_takes_its_rank_with_it(server, tmp_path) -> None:
    script, env = server
    proc = _start(script, env, "sleep", cwd=tmp_path)
    _ready(proc)
    rank = zygote.real_pid(proc.pid)
    assert rank != proc.pid and alive(rank)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(rank), f"rank {rank} outlived its SIGKILLed client"


def test_a_different_start_up_environment_runs_a_plain_interpreter(server, tmp_path) -> None:
    script, env = server
    proc = _start(script, {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}, "exit", "0",
                  cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"pid {proc.pid} " in out, out  # the client exec'd the interpreter: one process
