"""Reward-server faults, reproduced as a user meets them: a refused port, an invalid URL, an unknown scorer,
a host that never answers, a missing or wrong token, a server killed mid-run, a server bound beyond loopback
without a token, and OCR asked for an accelerator that onnxruntime cannot use. Each gives exit 2 (or a named
error) within seconds, with a message naming the URL and what failed (docs/faults.md)."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tqdm import tqdm

from megatron_omni.parallel.ports import free_port
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.rollout.base import FinishedSample
from megatron_omni.trainer.rewards import RewardFunction, RewardPreflightError, preflight
from tests.e2e.in_process import call_main

ROOT = Path(__file__).resolve().parents[2]
SLOW = "tests.e2e.test_reward_server:slow_brightness"


def _train(*args: str, env: dict | None = None, timeout: float = 240) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_omni.train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    return proc.returncode, proc.stderr, time.monotonic() - t0


def _last_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if "Warning" not in x and "warnings.warn" not in x]
    return lines[-1] if lines else ""


def test_refused_port_and_bad_url_exit_2_within_seconds(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    rc, err, took = _train("--set", f"reward.url=http://127.0.0.1:{port}/", "--set", f"run_dir={tmp_path}/r")
    assert rc == 2, err[-2000:]
    line = _last_line(err)
    assert line.startswith("config error: reward.url=") and f"127.0.0.1:{port}" in line and "refused" in line, line
    assert took < 60, took  # the interpreter's imports; the preflight itself is bounded below
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    # The other bad values through the entry point's `main` in this process (the command line's exit status is the
    # timed start's above; an interpreter start each would be the suite's budget): exit 2, one line naming the field.
    from megatron_omni.train import main

    for i, argv in enumerate((["--set", "reward.url=notaurl"], ["--dry-run", "--set", "reward.url=notaurl"],
                              ["--dry-run", "--set", "reward.scorer=nosuch"])):
        r = call_main(main, [*argv, "--set", f"run_dir={tmp_path}/r{i}"])
        assert r.returncode == 2 and _last_line(r.stderr).startswith(f"config error: {argv[-1].split('=')[0]}="), \
            r.stderr[-2000:]
        assert not (tmp_path / f"r{i}").exists()


def test_preflight_time_bound_and_what_failed() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RewardPreflightError, match=rf"127\.0\.0\.1:{port}.*connection refused"):
        preflight(f"http://127.0.0.1:{port}", timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(RewardPreflightError, match="DNS lookup failed"):
        preflight("http://no-such-host.invalid:8000", timeout_s=2.0)
    # A host that accepts the connection and never answers: bounded by the preflight's timeout.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(RewardPreflightError, match="timed out"):
            preflight(url, timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0
    assert preflight(None) is None


def test_token_refusal_at_preflight_and_beyond_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REWARD_SERVER_TOKEN", raising=False)
    with RewardServerProcess("jpeg_compressibility", token="s3cret") as srv:
        with pytest.raises(RewardPreflightError, match="requires a bearer token; set REWARD_SERVER_TOKEN"):
            preflight(srv.url)
        with pytest.raises(RewardPreflightError, match="wrong token"):
            preflight(srv.url, token="guess")
        monkeypatch.setenv("REWARD_SERVER_TOKEN", "s3cret")
        assert preflight(srv.url)["status"] == "ok"
        # The trainer's reward function sends the same variable's token with every request.
        fn = RewardFunction("jpeg_compressibility", srv.url, timeout_s=10)
        try:
            fn.begin(1)
            fn.on_sample(FinishedSample(index=0, prompt="p", group_id=0, seed=0, image=torch.rand(3, 16, 16)))
            assert fn.collect().shape == (1,)
        finally:
            fn.close()
    env = {k: v for k, v in os.environ.items() if k != "REWARD_SERVER_TOKEN"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_omni.reward.server", "--scorer", "jpeg_compressibility",
                           "--host", "0.0.0.0", "--port", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--host 0.0.0.0 is beyond loopback" in proc.stderr and "REWARD_SERVER_TOKEN" in proc.stderr
    assert time.monotonic() - t0 < 60


def test_waiting_shows_outstanding_in_the_progress_bar() -> None:
    with RewardServerProcess(SLOW, workers=1, max_batch=1, timeout_s=30) as srv:
        out = io.StringIO()
        bar = tqdm(total=1, file=out, mininterval=0)
        fn = RewardFunction("slow", srv.url, timeout_s=30)
        fn.progress = bar
        try:
            fn.begin(6)
            for i in range(6):
                fn.on_sample(FinishedSample(index=i, prompt="p", group_id=0, seed=i, image=torch.rand(3, 16, 16)))
            rewards = fn.collect()  # the slow scorer sleeps 0.2 s per image (1.2 s): the bar shows the wait
        finally:
            fn.close()
            bar.close()
        assert rewards.shape == (6,)
        shown = re.findall(r"waiting for rewards: (\d) outstanding", out.getvalue())
        assert shown and all(1 <= int(n) <= 6 for n in shown), out.getvalue()
        assert bar.postfix == "", bar.postfix  # cleared once the rewards are in


@pytest.mark.slow
def test_server_killed_mid_run_is_reported_within_timeout(tmp_path: Path) -> None:
    timeout_s = 4.0
    with RewardServerProcess("jpeg_compressibility") as srv:
        run_dir = tmp_path / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_omni.train", "--set", "steps=200", "--set", f"run_dir={run_dir}",
             "--set", f"reward.url={srv.url}", "--set", f"reward.timeout_s={timeout_s}",
             "--set", "logging.tensorboard=false"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        srv.kill()
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    assert proc.returncode == 1, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("reward server error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert line.startswith(f"reward server error: reward server {srv.url} gave no reward"), line
    assert f"within {timeout_s:g} s" in line and "requests outstanding]" in line, line
    # The step in flight when the server died, plus its samples' deadline, plus shutting down.
    print(f"\n{line}\nreported {took:.1f} s after the kill")
    assert took < timeout_s + 30, took


def test_ocr_on_an_accelerator_is_real_or_refused(tmp_path: Path) -> None:
    import onnxruntime

    from megatron_omni.reward.errors import RewardInputError
    from megatron_omni.reward.ocr import ACCELERATOR_PROVIDER, RapidOcrReader

    if ACCELERATOR_PROVIDER in onnxruntime.get_available_providers():
        pytest.fail("this test reproduces the CPU-only onnxruntime; the GPU image's is checked by its Dockerfile")
    providers = str(onnxruntime.get_available_providers())
    with pytest.raises(RewardInputError, match=ACCELERATOR_PROVIDER) as info:
        RapidOcrReader(device="cuda:0")
    assert providers in str(info.value)
    # The server's `main` in this process (its command line's exit 2 and one stderr line: the --host refusal in
    # test_token_refusal_at_preflight_and_beyond_loopback); the OCR scorer is built by the server below anyway.
    from megatron_omni.reward import server

    refused = call_main(server.main, ["--scorer", "ocr", "--devices", "cuda:0", "--port", "0"])
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2 and out.strip().count("\n") == 0, out
    assert out.startswith("reward server: error: OCR on 'cuda:0' needs onnxruntime's CUDAExecutionProvider")
    assert providers in out and "--allow-cpu-fallback" in out
    with RewardServerProcess("ocr", extra_args=["--devices", "cuda:0", "--allow-cpu-fallback"]) as srv:
        assert srv.health()["devices"] == ["cpu"]
        assert "CPU FALLBACK for cuda:0" in srv.log_tail()
        from PIL import Image, ImageDraw, ImageFont

        from megatron_omni.reward.client import RewardClient

        img = Image.new("RGB", (160, 64), "white")
        ImageDraw.Draw(img).text((10, 20), "HELLO", fill="black", font=ImageFont.truetype("DejaVuSans-Bold.ttf", 22))
        with RewardClient(srv.url, timeout_s=60) as client:
            assert client.score([np.asarray(img)], ['a sign "HELLO"']) == [1.0]
