"""Start a reward server as a child process and wait until it is healthy (trainer-side and tests).

    with RewardServerProcess("ocr", workers=1) as srv:
        client = RewardClient(srv.url)

The child binds a free loopback port (`--port 0`) and reports it through a port file written atomically,
so there is no race between picking a port and binding it. Its output goes to a log file whose tail is
quoted when it fails to start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from megatron_omni.reward.errors import RewardServiceError


class RewardServerProcess:
    """A `python -m megatron_omni.reward.server` child process."""

    def __init__(
        self,
        scorer: str | dict = "ocr",
        *,
        scorer_kwargs: dict | None = None,
        workers: int = 1,
        port: int = 0,
        host: str = "127.0.0.1",
        max_queue: int = 256,
        max_batch: int = 16,
        timeout_s: float = 60.0,
        token: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 120.0,
    ):
        self.scorer = scorer
        self.host = host
        self.requested_port = int(port)
        self.args = [
            "--scorer",
            scorer if isinstance(scorer, str) else json.dumps(scorer),
            "--scorer-kwargs",
            json.dumps(scorer_kwargs or {}),
            "--host",
            host,
            "--workers",
            str(workers),
            "--max-queue",
            str(max_queue),
            "--max-batch",
            str(max_batch),
            "--timeout",
            str(timeout_s),
            *(extra_args or []),
        ]
        self.token = token
        self.env = env
        self.startup_timeout_s = float(startup_timeout_s)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._dir = tempfile.mkdtemp(prefix="reward-server-")
        self.log_path = os.path.join(self._dir, "server.log")

    @property
    def url(self) -> str:
        """http://host:port of the running server."""
        if self.port is None:
            raise RewardServiceError("reward server not started")
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        """Last `n` characters of the server's output."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def start(self) -> RewardServerProcess:
        """Spawn the server and block until /health answers 200; RewardServiceError if it does not."""
        os.makedirs(self._dir, exist_ok=True)  # stop() removes it; the object may be started again
        self.port = None if self.requested_port == 0 else self.port
        port_file = os.path.join(self._dir, f"port-{time.monotonic_ns()}")
        env = {**os.environ, **(self.env or {})}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop("REWARD_SERVER_TOKEN", None)
        if self.token:
            env["REWARD_SERVER_TOKEN"] = self.token  # not on the command line, where `ps` shows it
        cmd = [
            sys.executable,
            "-m",
            "megatron_omni.reward.server",
            *self.args,
            "--port",
            str(self.requested_port),
            "--port-file",
            port_file,
        ]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RewardServiceError(
                    f"reward server exited with {self.proc.returncode} during start-up:\n{tail}"
                )
            if self.port is None and os.path.exists(port_file):
                with open(port_file) as f:
                    self.port = int(f.read())
            if self.port is not None and self._healthy():
                return self
            time.sleep(0.05)
        tail = self.log_tail()
        self.kill()
        self.stop()
        raise RewardServiceError(f"reward server not healthy within {self.startup_timeout_s:g} s:\n{tail}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def health(self) -> dict[str, Any]:
        """The /health body (raises when unreachable)."""
        with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
            return json.loads(resp.read())

    def kill(self) -> None:
        """SIGKILL the server and its workers (simulates a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (graceful), then SIGKILL after `timeout_s`; removes the log directory."""
        try:
            self._terminate(timeout_s)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _terminate(self, timeout_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        # Workers exit with their parent; make sure of it for anything left in the session.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> RewardServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
