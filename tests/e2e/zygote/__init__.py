"""Pre-imported interpreters for the e2e suite's ranks: a test's `python -m megatron_omni.train ...` (alone or as
torchrun's workers) becomes `python -S tests/e2e/zygote/client.py -m megatron_omni.train ...`, whose rank is forked
from this pytest worker's zygote server (server.py) instead of importing torch, megatron-core, diffusers and
transformers again: ~10 s of CPU of every rank, most of a tiny run's. The rank is the same code with the same
arguments, environment, working directory and stdio; its client stands for it (exit status, signals, death).

What differs from a fresh interpreter, and how the suite keeps it honest:
- a test that looks at a rank's process tree asks `real_pid` for the rank behind a client;
- every rank of a job shares the server's string-hash seed (PYTHONHASHSEED): an order of a set of strings that
  differs between ranks would show in the runs tests/distributed spawns and the launch-script tests (plain
  interpreters), not here;
- numpy's global generator is reseeded in each rank (a fresh interpreter seeds it from the OS), and the variables
  the preloaded imports set (cv2's LD_LIBRARY_PATH, say) are set in the rank's environment as its imports would;
- vLLM-Omni's engine entry point is preloaded too (`vllm_omni_preload`), so every rank holds what vLLM-Omni's
  import patches (vLLM's kernels, transformers' GLM-Image config, inductor's divisibility check: nothing a rank
  without an engine calls); vLLM reads its logging config and plugins from the environment at import, so a rank
  whose VLLM_LOGGING* / VLLM_CONFIGURE_LOGGING / VLLM_PLUGINS differ runs in a plain interpreter. An engine's worker
  processes fork from the rank's own fork server as they do outside the suite (`cpu_worker.worker_context`);
- a request whose start-up environment differs (PYTHONPATH with a fault-injection sitecustomize, say) runs in a
  plain interpreter, as does every command when MEGATRON_OMNI_TEST_ZYGOTE=0 is set."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.zygote.client import SOCKET_VARIABLE

ROOT = Path(__file__).resolve().parents[3]
CLIENT = Path(__file__).with_name("client.py")
_server: subprocess.Popen | None = None


def enabled() -> bool:
    """Whether ranks fork from a zygote (MEGATRON_OMNI_TEST_ZYGOTE=0: every rank a plain interpreter)."""
    return os.environ.get(SOCKET_VARIABLE, "1") != "0"


def rank_environment() -> dict[str, str]:
    """The environment the e2e tests give a rank (the server's; OMP_NUM_THREADS is set per rank)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def start_server(folder: Path, env: dict[str, str], preload: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
    """A zygote server listening in `folder` (its socket, its log, the client-to-rank pid files), started with `env`
    and importing `preload` (default server.PRELOAD); returns once it listens (the time its imports take)."""
    (folder / "pids").mkdir(parents=True, exist_ok=True)
    path = folder / "socket"
    server_env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS" and not k.startswith(SOCKET_VARIABLE)}
    server = subprocess.Popen([sys.executable, "-m", "tests.e2e.zygote.server", str(path), *preload], cwd=ROOT,
                              env=server_env, stdout=subprocess.DEVNULL, stderr=(folder / "server.log").open("w"),
                              start_new_session=True)
    deadline = time.monotonic() + 300
    while not path.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            server.wait()
            raise RuntimeError(f"zygote server did not start: {(folder / 'server.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return server, path


def client_environment(path: Path) -> dict[str, str]:
    """The variables that send a client's request to the server listening at `path`."""
    return {SOCKET_VARIABLE: str(path), SOCKET_VARIABLE + "_PIDS": str(path.parent / "pids")}


def _start(env: dict[str, str]) -> None:
    """This process's server (its ranks' environment `env`), stopped at exit; one that fails to start leaves every
    rank to a plain interpreter."""
    global _server
    try:
        _server, path = start_server(Path(tempfile.mkdtemp(prefix="zygote-")), env)
    except RuntimeError as exc:
        print(f"{exc}; ranks start plain interpreters", file=sys.stderr)
        os.environ[SOCKET_VARIABLE] = "0"
        return
    atexit.register(_stop)
    os.environ.update(client_environment(path))


def _stop() -> None:
    if _server is not None and _server.poll() is None:
        _server.kill()
        _server.wait()


def _client() -> list[str] | None:
    """The client's command prefix, this process's server started on first use; None where ranks start plain
    interpreters (MEGATRON_OMNI_TEST_ZYGOTE=0, or a server that did not start)."""
    if not enabled():
        return None
    if _server is None:
        _start(rank_environment())
    return None if os.environ.get(SOCKET_VARIABLE) == "0" else [sys.executable, "-S", str(CLIENT)]


def python_m(module: str) -> list[str]:
    """The command that runs `python -m module` through this process's zygote, or the plain one. A rank whose
    environment differs from `rank_environment()` in what an interpreter's start reads runs in a plain interpreter
    all the same (server.STARTUP_VARIABLES)."""
    return [*(_client() or [sys.executable]), "-m", module]


def python_script(script: str | os.PathLike) -> list[str]:
    """`python_m` for `python SCRIPT`."""
    return [*(_client() or [sys.executable]), str(script)]


def torchrun(nproc: int, port: int, rank: list[str]) -> list[str]:
    """torchrun starting `nproc` ranks of `rank` (a `python_m` or `python_script` command) on `port`: a zygote
    client is the worker command itself (`--no-python`), a plain interpreter's `-m MODULE` or SCRIPT torchrun's."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)]
    return [*launch, "--no-python", *rank] if rank[1] == "-S" else [*launch, *rank[1:]]


def real_pid(pid: int, timeout_s: float = 30) -> int:
    """The rank behind client `pid` (the pid file its client writes once the server has forked the rank), or `pid`
    itself where that process is a plain interpreter (no client, or one that exec'd it)."""
    key = (SOCKET_VARIABLE + "_PIDS=").encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return pid
        folder = next((e[len(key):].decode() for e in environ if e.startswith(key)), None)
        if folder is None or str(CLIENT).encode() not in cmdline:
            return pid
        marker = Path(folder) / str(pid)
        if marker.exists():
            return int(marker.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"client {pid} named no rank within {timeout_s} s")
