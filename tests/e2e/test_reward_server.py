"""The reward server as a real subprocess on a free localhost port, driven over HTTP.

Covers: HTTP scoring equals in-process scoring, malformed requests get a 4xx with a message, bearer-token
auth, a full queue pushes back (429 + Retry-After) and the client's backoff gets through it, the
per-request timeout (504), a killed server fails the client with a clear error within its timeout, and a
restarted server is used again by the same client.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time

import aiohttp
import numpy as np
import psutil
import pytest
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.client import AsyncRewardClient, RewardClient
from megatron_omni.reward.errors import RewardServiceError
from megatron_omni.reward.images import encode_png_b64
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.reward.registry import build_scorer

SLOW = f"{__name__}:slow_brightness"


def slow_brightness(images, prompts, metadata):
    """A user scorer (imported by the server by path) that takes metadata['sleep'] s per batch."""
    time.sleep(max((m.get("sleep", 0.2) for m in metadata), default=0.0))
    if any(m.get("fail") for m in metadata):
        raise RuntimeError("judge crashed")
    return [float(np.asarray(im).mean()) / 255.0 for im in images]


def render(text: str) -> Image.Image:
    img = Image.new("RGB", (160, 64), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 20), text, fill="black", font=ImageFont.truetype("DejaVuSans-Bold.ttf", 22))
    return img


def samples() -> tuple[list, list[str]]:
    rng = np.random.default_rng(0)
    imgs = [
        render("HELLO"),
        render("HELP"),
        render("WORLD"),
        render("OCR 2"),
        Image.new("RGB", (96, 96), "white"),
        rng.integers(0, 256, (96, 96, 3), dtype=np.uint8),
    ]
    prompts = ['a sign "HELLO"', '"HELLO"', 'text "WORLD"', 'it says "OCR 2"', '"HELLO"', '"HELLO"']
    return imgs, prompts


@pytest.fixture(scope="module")
def reward_ocr_server():
    with RewardServerProcess("ocr", workers=1, max_queue=64, timeout_s=60) as srv:
        yield srv


@pytest.fixture(scope="module")
def reward_slow_server():
    with RewardServerProcess(SLOW, workers=1, max_queue=2, max_batch=1, timeout_s=1.0) as srv:
        yield srv


async def _post(url: str, body, *, raw: bytes | None = None, headers: dict | None = None):
    async with aiohttp.ClientSession() as s:
        kw = {"data": raw} if raw is not None else {"json": body}
        async with s.post(url + "/score", headers=headers or {}, **kw) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


def post(url: str, body=None, **kw):
    return asyncio.run(_post(url, body, **kw))


def item(img, prompt: str, **extra) -> dict:
    return {"image": encode_png_b64(img), "prompt": prompt, **extra}


# --------------------------------------------------------------------------------------------- scoring


def test_health(reward_ocr_server: RewardServerProcess) -> None:
    h = reward_ocr_server.health()
    assert h["status"] == "ok" and h["scorer"] == "ocr" and h["workers"] == 1


def test_http_equals_in_process(reward_ocr_server: RewardServerProcess) -> None:
    imgs, prompts = samples()
    local = build_scorer("ocr")(imgs, prompts)
    assert local[0] >= 0.95 and 0 < local[1] < 1 and local[4] == local[5] == 0.0
    with RewardClient(reward_ocr_server.url, timeout_s=30) as client:
        assert client.score(imgs, prompts) == local
        # Streaming: submitted out of order as a rollout would finish them, gathered in sample order.
        for i in [3, 0, 5, 1, 4, 2]:
            client.submit(i, imgs[i], prompts[i])
        assert client.gather() == local
        client.submit(0, imgs[1], "no quotes", {"target": "HELLO"})
        assert client.gather() == [local[1]]


def test_async_client_submit_gather(reward_ocr_server: RewardServerProcess) -> None:
    imgs, prompts = samples()
    local = build_scorer("ocr")(imgs, prompts)

    async def run() -> list[float]:
        async with AsyncRewardClient(reward_ocr_server.url, timeout_s=30) as c:
            for i in reversed(range(len(imgs))):
                c.submit(i, imgs[i], prompts[i])
                await asyncio.sleep(0)
            with pytest.raises(ValueError, match="already submitted"):
                c.submit(0, imgs[0], prompts[0])
            return await c.gather()

    assert asyncio.run(run()) == local


def test_malformed_requests_get_4xx_with_message(reward_ocr_server: RewardServerProcess) -> None:
    url = reward_ocr_server.url
    img = render("HELLO")
    cases = [
        (dict(raw=b"{not json"), 400, "not valid JSON"),
        (dict(body={"images": []}), 400, "items"),
        (dict(body={"items": []}), 400, "items"),
        (dict(body={"items": [{"image": "%%%notbase64", "prompt": '"A"'}]}), 400, "base64"),
        (
            dict(body={"items": [{"image": base64.b64encode(b"hello").decode(), "prompt": '"A"'}]}),
            400,
            "not a decodable image",
        ),
        (dict(body={"items": [{"image": encode_png_b64(img)}]}), 400, "prompt must be a string"),
        (dict(body={"items": [item(img, '"A"', metadata=[1])]}), 400, "metadata must be an object"),
        (dict(body={"items": [item(img, "a prompt without quotes")]}), 422, "quotes no text"),
        (dict(body={"items": [item(img, '"A"')] * 65}), 413, "exceed the queue bound"),
    ]
    for kw, status, needle in cases:
        body = kw.pop("body", None)
        got, data, _ = post(url, body, **kw)
        assert got == status, (needle, got, data)
        assert needle in data["error"], (needle, data)
    # A client sees a 4xx as a clear error at once (no retries, no reward of 0).
    with RewardClient(url, timeout_s=30) as client:
        t0 = time.monotonic()
        client.submit(0, img, "no target")
        with pytest.raises(RewardServiceError, match="422.*quotes no text"):
            client.gather()
        assert time.monotonic() - t0 < 5 and client.retries == 0
    # One bad item in a batch does not fail its batch-mates.
    status, data, _ = post(url, {"items": [item(img, '"HELLO"')]})
    assert status == 200 and data["rewards"][0] >= 0.95


def test_bearer_token_auth_and_cpu_pinning() -> None:
    cpu = max(os.sched_getaffinity(0))
    with RewardServerProcess("jpeg_compressibility", token="s3cret", extra_args=["--cpus", str(cpu)]) as srv:
        server = psutil.Process(srv.proc.pid)
        workers = server.children(recursive=True)
        assert workers and all(p.cpu_affinity() == [cpu] for p in [server, *workers])
        img = Image.new("RGB", (32, 32), "gray")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, data, _ = post(srv.url, {"items": [item(img, "")]}, headers=headers)
            assert status == 401 and "token" in data["error"]
        status, data, _ = post(
            srv.url, {"items": [item(img, "", id="x")]}, headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and data["ids"] == ["x"]
        with RewardClient(srv.url, token="s3cret", timeout_s=10) as client:
            assert client.score([img], [""]) == build_scorer("jpeg_compressibility")([img], [""])
        with RewardClient(srv.url, timeout_s=10) as client, pytest.raises(RewardServiceError, match="401"):
            client.score([img], [""])


# ---------------------------------------------------------------------------------- pushback, timeout


def test_full_queue_pushes_back_and_client_backs_off(reward_slow_server: RewardServerProcess) -> None:
    url = reward_slow_server.url
    img = Image.new("RGB", (16, 16), (255, 255, 255))

    async def burst() -> list:
        return await asyncio.gather(
            *(_post(url, {"items": [item(img, "", id=i, metadata={"sleep": 0.3})]}) for i in range(6))
        )

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 6 and 1 <= len(ok) <= 3 and refused, [r[0] for r in results]
    for _, data, headers in refused:
        assert (
            int(headers["Retry-After"]) >= 1 and data["retry_after_s"] > 0 and "queue full" in data["error"]
        )
    # The same overload through the client: everyone gets a reward, in order, thanks to backoff.
    with RewardClient(url, timeout_s=30, backoff_s=0.05, max_backoff_s=0.5) as client:
        for i in range(6):
            client.submit(i, img, "", {"sleep": 0.1})
        assert client.gather() == [1.0] * 6
        assert client.retries > 0


def test_per_request_timeout(reward_slow_server: RewardServerProcess) -> None:
    img = Image.new("RGB", (16, 16), (0, 0, 0))
    t0 = time.monotonic()
    status, data, headers = post(reward_slow_server.url, {"items": [item(img, "", metadata={"sleep": 2.0})]})
    assert status == 504 and "not scored within 1 s" in data["error"] and "Retry-After" in headers
    assert time.monotonic() - t0 < 1.9
    time.sleep(1.2)  # let the worker finish the abandoned batch before the next test


# ------------------------------------------------------------------------------------ death, restart


def test_killed_server_fails_client_within_timeout_and_restart_is_used() -> None:
    srv = RewardServerProcess(SLOW, workers=1, timeout_s=30).start()
    img = Image.new("RGB", (16, 16), (255, 255, 255))
    client = RewardClient(srv.url, timeout_s=3.0, backoff_s=0.05, max_backoff_s=0.5)
    try:
        assert client.score([img], [""], [{"sleep": 0.0}]) == [1.0]
        # Killed while a request is in flight.
        client.submit(0, img, "", {"sleep": 5.0})
        time.sleep(0.5)
        srv.kill()
        t0 = time.monotonic()
        with pytest.raises(RewardServiceError, match=rf"{srv.url}.*within 3 s.*last error"):
            client.gather()
        assert time.monotonic() - t0 < 4.0
        # Dead before the request: connection refused until the deadline, then a clear error.
        t0 = time.monotonic()
        client.submit(0, img, "", {"sleep": 0.0})
        with pytest.raises(RewardServiceError, match="Connect"):
            client.gather()
        assert 2.0 < time.monotonic() - t0 < 4.0
        # Restarted on the same port: the same client instance is served again.
        srv2 = RewardServerProcess(SLOW, workers=1, port=srv.port).start()
        try:
            assert client.score([img], [""], [{"sleep": 0.0}]) == [1.0]
            srv2.kill()
            # A restart that completes within the client's timeout is bridged by the retries.
            client.submit(0, img, "", {"sleep": 0.0})
            srv3 = RewardServerProcess(SLOW, workers=1, port=srv.port)
            # Generous: a cold start imports torch and the scorer, slow on a loaded 2-core machine.
            client_wait = RewardClient(srv.url, timeout_s=240.0, backoff_s=0.05, max_backoff_s=0.5)
            client_wait.submit(0, img, "", {"sleep": 0.0})
            with pytest.raises(RewardServiceError):
                client.gather()  # 3 s is less than a cold start on this machine
            srv3.start()
            try:
                assert client_wait.gather() == [1.0]
                assert client_wait.retries > 0
            finally:
                client_wait.close()
                srv3.stop()
        finally:
            srv2.stop()
    finally:
        client.close()
        srv.stop()


def test_scorer_failure_is_an_error_not_a_zero(reward_slow_server: RewardServerProcess) -> None:
    img = Image.new("RGB", (16, 16), (255, 255, 255))
    status, data, _ = post(
        reward_slow_server.url, {"items": [item(img, "", metadata={"sleep": 0.0, "fail": 1})]}
    )
    assert status == 500 and "RuntimeError: judge crashed" in data["error"]
    with RewardClient(reward_slow_server.url, timeout_s=10) as client:
        client.submit(0, img, "", {"sleep": 0.0})
        client.submit(1, img, "", {"sleep": 0.0, "fail": 1})
        with pytest.raises(RewardServiceError, match="500.*judge crashed"):
            client.gather()


def test_unbuildable_scorer_fails_start_with_its_reason() -> None:
    with pytest.raises(
        RewardServiceError, match=r"(?s)exited with 1 during start-up.*unknown scorer 'no_such'"
    ):
        RewardServerProcess("no_such", startup_timeout_s=240).start()
