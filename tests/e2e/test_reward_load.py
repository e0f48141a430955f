"""Load on a real OCR reward server from several client processes: nothing lost, nothing duplicated.

Rate: four times what one trainer step of the reference recipe produces (32 prompts x 16 samples = 512
images per ~250 s step on 4xH200, docs/design.md section 3), i.e. about 8.2 requests/s, as Poisson arrivals
split over 4 client processes, bounded in time. A second, burst phase sends every request of every process
at once into a small queue, so the push-back path runs under concurrency too.

Every request must end exactly once: 200 with its own id and the reward the scorer gives in-process, or
429/503 with a Retry-After header. In the Poisson phase the clients do what the trainer's `RewardClient` does
with a refusal: wait the server's hint and send again. So every request must end answered within RETRY_FOR_S
of its first send (a server that could not keep up with the offered rate on average would leave requests
refused past that bound). How many are answered at the first try is printed, not asserted: it measures the
machine, not the server's behaviour (alone on a 2-core CPU machine: 108 of 108, p99 177 ms; with the other
pytest worker training beside it: 99 of 108 in one CI run, 67 of 108 in a later full run, each one a correct
push-back with Retry-After, answered on a retry). The burst (no retries) must be answered for at least the
queue's capacity (the 16 items the queue admits before it pushes back; measured: 16 of 64). The server's
counters must agree with what the clients saw (no request scored twice, none dropped, each refusal counted
once). Latency percentiles are printed (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import random
import time

import aiohttp
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.images import encode_png_b64
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.reward.registry import build_scorer

STEP_IMAGES = 512
STEP_SECONDS = 250.0
RATE_PER_S = 4 * STEP_IMAGES / STEP_SECONDS
N_PROCS = 4
DURATION_S = 12.0
RETRY_FOR_S = 60.0  # a refused request is sent again until this long after it was first sent
MAX_QUEUE = 16
WORDS = ["HELLO", "HELP", "WORLD", "OCR"]
PROMPT = 'a sign that says "HELLO"'


def _images() -> list[Image.Image]:
    out = []
    for w in WORDS:
        img = Image.new("RGB", (128, 64), "white")
        ImageDraw.Draw(img).text((8, 18), w, fill="black", font=ImageFont.truetype("DejaVuSans-Bold.ttf", 22))
        out.append(img)
    return out


async def _one(session, url: str, rid: str, payload: str, t_fire: float, retry: bool) -> dict:
    """One request; with `retry`, a 429/503 is sent again after the body's retry_after_s hint (or, as the
    trainer's client does, an exponential backoff when that is longer), for up to RETRY_FOR_S."""
    body = {"items": [{"id": rid, "image": payload, "prompt": PROMPT}]}
    refusals, backoff_s = [], 0.05
    while True:
        async with session.post(url + "/score", json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            data = await resp.json(content_type=None)
            out = {
                "id": rid,
                "status": resp.status,
                "latency": time.monotonic() - t_fire,
                "data": data,
                "retry_after": resp.headers.get("Retry-After"),
                "refusals": refusals,
            }
        if not retry or out["status"] not in (429, 503) or out["latency"] > RETRY_FOR_S:
            return out
        refusals.append({k: out[k] for k in ("status", "data", "retry_after")})
        await asyncio.sleep(max(float(data.get("retry_after_s") or 1.0), backoff_s))
        backoff_s = min(2.0, 2 * backoff_s)


async def _client(proc: int, url: str, arrivals: list[float], start_at: float, retry: bool) -> list[dict]:
    payloads = [encode_png_b64(im) for im in _images()]
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for k, t in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            rid = f"p{proc}-{k}-{k % len(WORDS)}"
            tasks.append(
                asyncio.create_task(_one(session, url, rid, payloads[k % len(WORDS)], time.monotonic(), retry))
            )
        return list(await asyncio.gather(*tasks))


def client_process(proc: int, url: str, arrivals: list[float], start_at: float, retry: bool) -> list[dict]:
    """Runs in a spawned process: fire requests at the given offsets (open loop), return every outcome."""
    return asyncio.run(_client(proc, url, arrivals, start_at, retry))


def _percentiles(lat: list[float]) -> str:
    p50, p90, p99 = np.percentile(np.asarray(lat) * 1000, [50, 90, 99])
    return f"p50 {p50:.0f} ms, p90 {p90:.0f} ms, p99 {p99:.0f} ms"


def _run_phase(
    srv: RewardServerProcess,
    schedules: list[list[float]],
    expected: list[float],
    label: str,
    min_answered: int,
    retry: bool,
) -> None:
    """Send the schedules; without `retry`, at least `min_answered` must be answered at the only try."""
    before = srv.health()["stats"]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(schedules), mp_context=ctx) as pool:
        start_at = time.time() + 3.0
        futs = [pool.submit(client_process, p, srv.url, s, start_at, retry) for p, s in enumerate(schedules)]
        outcomes = [o for f in futs for o in f.result(timeout=240)]
    after = srv.health()["stats"]

    sent = [f"p{p}-{k}-{k % len(WORDS)}" for p, s in enumerate(schedules) for k in range(len(s))]
    got_ids = [o["id"] for o in outcomes]
    assert sorted(got_ids) == sorted(sent) and len(set(got_ids)) == len(sent)  # each request ends once
    ok = [o for o in outcomes if o["status"] == 200]
    refused = [o for o in outcomes if o["status"] in (429, 503)]
    assert len(ok) + len(refused) == len(sent), {o["status"] for o in outcomes}
    for o in ok:
        assert o["data"]["ids"] == [o["id"]], o  # the answer is for this request, not another one
        assert o["data"]["rewards"] == [expected[int(o["id"].rsplit("-", 1)[1])]], o
    refusals = [r for o in outcomes for r in o["refusals"]] + [
        {k: o[k] for k in ("status", "data", "retry_after")} for o in refused
    ]
    for r in refusals:
        assert r["retry_after"] is not None and int(r["retry_after"]) >= 1 and "error" in r["data"], r
    if retry:
        assert not refused, f"{label}: {len(refused)} requests still refused after {RETRY_FOR_S:g} s"
    # Server-side: every 200 scored exactly once, every refusal counted, nothing else happened.
    assert after["answered"] - before["answered"] == len(ok)
    assert after["items_scored"] - before["items_scored"] == len(ok)
    assert (after["refused"] + after["not_ready"]) - (before["refused"] + before["not_ready"]) == len(refusals)
    assert after["timed_out"] == before["timed_out"] and after["errors"] == before["errors"]
    first_try = [o for o in ok if not o["refusals"]]
    if not retry:  # the burst's floor is the queue's capacity, which holds at any machine speed
        assert len(first_try) >= min_answered, (
            f"{label}: {len(first_try)} of {len(sent)} answered, need the queue's {min_answered}"
        )
    span = max(max(s) for s in schedules if s) if any(schedules) else 0.0
    print(
        f"\n[reward load/{label}] {len(sent)} requests from {len(schedules)} processes over {span:.1f} s: "
        f"{len(ok)} answered ({len(first_try)} at the first try), {len(refusals)} refusals with Retry-After; "
        f"latency of answered (retries included): "
        f"{_percentiles([o['latency'] for o in ok])}; batches {after['batches'] - before['batches']}"
    )


@pytest.fixture(scope="module")
def reward_load_server():
    with RewardServerProcess("ocr", workers=1, max_queue=MAX_QUEUE, max_batch=8, timeout_s=60) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_load_four_times_step_rate(reward_load_server: RewardServerProcess) -> None:
    expected = build_scorer("ocr")(_images(), [PROMPT] * len(WORDS))
    rng = random.Random(7)
    schedules = []
    for _ in range(N_PROCS):
        t, arrivals = 0.0, []
        while True:
            t += rng.expovariate(RATE_PER_S / N_PROCS)
            if t > DURATION_S:
                break
            arrivals.append(t)
        schedules.append(arrivals)
    n = sum(len(a) for a in schedules)
    assert n > 80  # 12 s at 8.2/s
    _run_phase(reward_load_server, schedules, expected, f"poisson {RATE_PER_S:.1f}/s", 0, retry=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_load_burst_pushes_back_without_loss(reward_load_server: RewardServerProcess) -> None:
    expected = build_scorer("ocr")(_images(), [PROMPT] * len(WORDS))
    # 4 processes x 16 requests at the same instant into a queue of 16: most must be refused, cleanly.
    _run_phase(reward_load_server, [[0.0] * 16 for _ in range(N_PROCS)], expected, "burst 64", MAX_QUEUE, retry=False)
