"""The reward server: scorers in worker processes behind an aiohttp HTTP API.

    python -m megatron_omni.reward.server --scorer ocr [--host 127.0.0.1] [--port 8000] [--workers 1]
        [--devices type:0,type:1] [--max-queue 256] [--max-batch 16] [--batch-wait-ms 0] [--timeout 60]
        [--token T | env REWARD_SERVER_TOKEN] [--scorer-kwargs JSON] [--port-file PATH] [--cpus 1]

`--cpus` pins the server and its CPU workers to their own cores (the CPU form of "the reward on its own
GPUs"): without it, a rollout and an OCR worker on the same cores slow each other and overlap saves less.

API (JSON):
- GET /health -> 200 {"status": "ok", "scorer", "workers", "pending", "max_queue", "stats"} once every
  worker has built its scorer; 503 {"status": "starting"} before.
- POST /score {"items": [{"id": any, "image": base64 PNG, "prompt": str, "metadata": {...}}, ...]}
  -> 200 {"ids": [...], "rewards": [...]} in item order.
  400 malformed request, 401 missing/wrong bearer token, 413 more items than the queue holds, 422 an item
  the scorer cannot score (e.g. no target text), 429 queue full (Retry-After), 503 not ready
  (Retry-After), 504 not scored within --timeout, 500 scorer failure. Errors are {"error": message}.

Requests from all clients go into one queue; each worker takes up to --max-batch waiting items at a time
(micro-batching), so batches grow with load and stay at one item when idle. The queue is bounded by
--max-queue items admitted and not yet answered; beyond it, requests are refused at once with 429 rather
than queued without bound, so a client can back off instead of timing out.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.images import decode_b64, decode_png
from megatron_omni.reward.workers import ScorerWorker

LOOPBACK = "127.0.0.1"


@dataclass
class ServerConfig:
    """Everything the server needs; the CLI fills it."""

    scorer: Any = "ocr"
    scorer_kwargs: dict = field(default_factory=dict)
    host: str = LOOPBACK
    port: int = 8000
    workers: int = 1
    devices: list[str] | None = None
    threads: int = 1
    max_queue: int = 256
    max_batch: int = 16
    batch_wait_s: float = 0.0
    timeout_s: float = 60.0
    token: str | None = None
    cpus: set[int] | None = None  # pin the server and its workers (workers inherit the affinity)
    max_body_bytes: int = 64 * 1024 * 1024


@dataclass
class _Pending:
    png: bytes
    prompt: str
    metadata: dict
    future: asyncio.Future


@dataclass
class _Stats:
    answered: int = 0  # requests answered 200
    items_scored: int = 0
    batches: int = 0
    refused: int = 0  # 429 queue full
    not_ready: int = 0  # 503
    timed_out: int = 0  # 504
    bad_requests: int = 0  # 400/401/413/422
    errors: int = 0  # 500
    busy_s: float = 0.0  # summed worker time, for the Retry-After estimate


class RewardServer:
    """The aiohttp application with its queue, dispatchers and workers."""

    def __init__(self, cfg: ServerConfig):
        if cfg.max_queue < 1 or cfg.max_batch < 1 or cfg.timeout_s <= 0:
            raise ValueError("max_queue and max_batch must be >= 1 and timeout > 0")
        devices = cfg.devices or [None] * cfg.workers
        if not devices:
            raise ValueError("need at least one worker or device")
        self.cfg = cfg
        self.workers = [
            ScorerWorker(cfg.scorer, cfg.scorer_kwargs, device=d, threads=cfg.threads) for d in devices
        ]
        self.scorer_name: str | None = None
        self.ready = False
        self.fatal: str | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        self.pending = 0
        self.stats = _Stats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._tasks: list[asyncio.Task] = []
        self.app = web.Application(client_max_size=cfg.max_body_bytes)
        self.app.router.add_get("/health", self.handle_health)
        self.app.router.add_post("/score", self.handle_score)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    # ------------------------------------------------------------------ lifecycle

    async def _on_startup(self, app: web.Application) -> None:
        self._queue = asyncio.Queue()
        self._tasks.append(asyncio.create_task(self._start_workers()))

    async def _start_workers(self) -> None:
        try:
            names = await asyncio.gather(*(w.start() for w in self.workers))
        except BaseException as exc:
            # A scorer that cannot be built is fatal: exit rather than serve 503 forever.
            self.fatal = f"building scorer {self.cfg.scorer!r} failed: {type(exc).__name__}: {exc}"
            print(f"reward server: {self.fatal}", file=sys.stderr, flush=True)
            self.on_fatal()
            raise
        self.scorer_name = names[0]
        for w in self.workers:
            self._tasks.append(asyncio.create_task(self._dispatch(w)))
        self.ready = True
        print(f"reward server: scorer {self.scorer_name} ready on {len(self.workers)} worker(s)", flush=True)

    async def _on_cleanup(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:
            w.stop()

    # ------------------------------------------------------------------ batching

    async def _dispatch(self, worker: ScorerWorker) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            if self.cfg.batch_wait_s > 0 and len(batch) < self.cfg.max_batch and self._queue.empty():
                await asyncio.sleep(self.cfg.batch_wait_s)
            while len(batch) < self.cfg.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            live = [p for p in batch if not p.future.done()]  # requests that timed out are dropped
            self.pending -= len(batch) - len(live)
            if not live:
                continue
            t0 = time.perf_counter()
            try:
                results = await worker.score([(p.png, p.prompt, p.metadata) for p in live])
            except Exception as exc:
                results = [("error", f"{type(exc).__name__}: {exc}")] * len(live)
            self.stats.busy_s += time.perf_counter() - t0
            self.stats.batches += 1
            self.stats.items_scored += len(live)
            self.pending -= len(live)
            for p, r in zip(live, results):
                if not p.future.done():
                    p.future.set_result(r)

    def _retry_after_s(self) -> float:
        """Expected wait until the queue has drained by half (a hint, at least 50 ms)."""
        per_item = self.stats.busy_s / self.stats.items_scored if self.stats.items_scored else 0.05
        return max(0.05, 0.5 * self.pending * per_item / len(self.workers))

    # ------------------------------------------------------------------ handlers

    def _error(self, status: int, message: str, retry_after_s: float | None = None) -> web.Response:
        headers = {}
        body: dict[str, Any] = {"error": message}
        if retry_after_s is not None:
            # The header takes whole seconds (RFC 9110); the body carries the finer hint.
            headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
            body["retry_after_s"] = round(retry_after_s, 3)
        return web.json_response(body, status=status, headers=headers)

    def _authorized(self, request: web.Request) -> bool:
        if self.cfg.token is None:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.cfg.token}".encode())

    async def handle_health(self, request: web.Request) -> web.Response:
        """Liveness/readiness: 200 once the scorers are built. Open to all (launch scripts poll it), but a
        request that carries a wrong bearer token gets 401, so a client can check its token before scoring."""
        if "Authorization" in request.headers and not self._authorized(request):
            return self._error(401, "missing or wrong bearer token")
        body = {
            "token_required": self.cfg.token is not None,
            "status": "ok" if self.ready else "starting",
            "scorer": self.scorer_name,
            "workers": len(self.workers),
            "devices": [w.device or "cpu" for w in self.workers],
            "pending": self.pending,
            "max_queue": self.cfg.max_queue,
            "stats": vars(self.stats),
        }
        return web.json_response(body, status=200 if self.ready else 503)

    def _parse_items(self, body: Any) -> list[tuple[Any, bytes, str, dict]]:
        if not isinstance(body, dict) or not isinstance(body.get("items"), list) or not body["items"]:
            raise RewardInputError('body must be {"items": [{"image": <base64 PNG>, "prompt": str}, ...]}')
        out = []
        for i, item in enumerate(body["items"]):
            if not isinstance(item, dict):
                raise RewardInputError(f"items[{i}] must be an object")
            prompt = item.get("prompt")
            if not isinstance(prompt, str):
                raise RewardInputError(f"items[{i}].prompt must be a string")
            meta = item.get("metadata", {})
            if meta is None:
                meta = {}
            if not isinstance(meta, dict):
                raise RewardInputError(f"items[{i}].metadata must be an object")
            try:
                png = decode_b64(item.get("image"))
                decode_png(png)  # reject undecodable images here with a 400, not later as a scorer error
            except RewardInputError as exc:
                raise RewardInputError(f"items[{i}]: {exc}") from exc
            out.append((item.get("id", i), png, prompt, meta))
        return out

    async def handle_score(self, request: web.Request) -> web.Response:
        """Score a request's items; see the module docstring for the statuses."""
        if not self._authorized(request):
            self.stats.bad_requests += 1
            return self._error(401, "missing or wrong bearer token")
        if not self.ready:
            self.stats.not_ready += 1
            return self._error(503, "scorers are still starting", retry_after_s=1.0)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.stats.bad_requests += 1
            return self._error(400, f"body is not valid JSON: {exc}")
        try:
            items = self._parse_items(body)
        except RewardInputError as exc:
            self.stats.bad_requests += 1
            return self._error(400, str(exc))
        n = len(items)
        if n > self.cfg.max_queue:
            self.stats.bad_requests += 1
            return self._error(413, f"{n} items in one request exceed the queue bound {self.cfg.max_queue}")
        if self.pending + n > self.cfg.max_queue:
            self.stats.refused += 1
            return self._error(
                429,
                f"queue full ({self.pending}/{self.cfg.max_queue} items)",
                retry_after_s=self._retry_after_s(),
            )
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        pend = [_Pending(png, prompt, meta, loop.create_future()) for _, png, prompt, meta in items]
        self.pending += n
        for p in pend:
            self._queue.put_nowait(p)
        try:
            results = await asyncio.wait_for(asyncio.gather(*(p.future for p in pend)), self.cfg.timeout_s)
        except TimeoutError:
            self.stats.timed_out += 1
            return self._error(
                504, f"not scored within {self.cfg.timeout_s:g} s", retry_after_s=self._retry_after_s()
            )
        for i, (kind, value) in enumerate(results):
            if kind == "input_error":
                self.stats.bad_requests += 1
                return self._error(422, f"items[{i}]: {value}")
            if kind != "ok":
                self.stats.errors += 1
                return self._error(500, f"scorer {self.scorer_name} failed on items[{i}]: {value}")
        self.stats.answered += 1
        return web.json_response({"ids": [it[0] for it in items], "rewards": [r for _, r in results]})


async def serve(cfg: ServerConfig, port_file: str | None = None) -> None:
    """Run the server until SIGTERM/SIGINT; writes the bound port to `port_file` (atomically) if given."""
    if cfg.cpus:
        os.sched_setaffinity(0, cfg.cpus)  # before the workers start (at app startup): they inherit it
    server = RewardServer(cfg)
    stop = asyncio.Event()
    server.on_fatal = stop.set
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    print(f"reward server: listening on http://{cfg.host}:{port} (scorer {cfg.scorer!r})", flush=True)
    if port_file:
        tmp = f"{port_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, port_file)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    if server.fatal:
        raise SystemExit(1)  # the reason was printed when it happened


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, str | None]:
    """CLI -> (ServerConfig, port_file)."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_omni.reward.server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--scorer", required=True, help="registered name, 'module:function', or '0.8*ocr+0.2*x'")
    p.add_argument("--scorer-kwargs", default="{}", help="JSON object of scorer constructor options")
    p.add_argument("--host", default=LOOPBACK, help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--workers", type=int, default=1, help="CPU worker processes (ignored with --devices)")
    p.add_argument(
        "--devices", default=None, help="comma-separated devices, one worker each (e.g. 'type:0,type:1')"
    )
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    p.add_argument("--cpus", default=None, help="pin the server and its workers to these CPUs ('1', '2-5,7')")
    p.add_argument("--max-queue", type=int, default=256, help="items admitted and not yet answered")
    p.add_argument("--max-batch", type=int, default=16, help="items per scorer call")
    p.add_argument("--batch-wait-ms", type=float, default=0.0, help="linger to grow a batch when idle")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request seconds before a 504")
    p.add_argument("--token", default=os.environ.get("REWARD_SERVER_TOKEN"),
                   help="require this bearer token (default: env REWARD_SERVER_TOKEN); needed beyond loopback")
    p.add_argument("--allow-cpu-fallback", action="store_true",
                   help="OCR on --devices whose onnxruntime provider is missing scores on the CPU (printed) "
                        "instead of refusing to start")
    a = p.parse_args(argv)
    try:
        kwargs = json.loads(a.scorer_kwargs)
    except json.JSONDecodeError as exc:
        p.error(f"--scorer-kwargs is not JSON: {exc}")
    if not isinstance(kwargs, dict):
        p.error("--scorer-kwargs must be a JSON object")
    scorer: Any = a.scorer
    if scorer.lstrip().startswith("{"):
        scorer = json.loads(scorer)
    devices = [d.strip() for d in a.devices.split(",") if d.strip()] if a.devices else None
    cpus = None
    if a.cpus is not None:
        try:
            cpus = parse_cpu_list(a.cpus)
        except ValueError as exc:
            p.error(str(exc))
    if a.host not in (LOOPBACK, "localhost", "::1") and not a.token:
        _fail(f"--host {a.host} is beyond loopback: anyone who can reach it could use it; give --token or set "
                "REWARD_SERVER_TOKEN (the trainer sends the same variable), or bind 127.0.0.1")
    if devices:
        devices = _ocr_devices(scorer, devices, a.allow_cpu_fallback)
    cfg = ServerConfig(
        scorer=scorer,
        scorer_kwargs=kwargs,
        host=a.host,
        port=a.port,
        workers=a.workers,
        devices=devices,
        threads=a.threads,
        max_queue=a.max_queue,
        max_batch=a.max_batch,
        batch_wait_s=a.batch_wait_ms / 1000.0,
        timeout_s=a.timeout,
        token=a.token,
        cpus=cpus,
    )
    return cfg, a.port_file


def _fail(message: str) -> None:
    """One line and exit 2 (a server that cannot start as asked; no usage text to hide the line)."""
    print(f"reward server: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _ocr_devices(scorer: Any, devices: list[str], allow_cpu_fallback: bool) -> list[str]:
    """The devices an OCR scorer's workers get: each accelerator must have onnxruntime's provider, else the
    server refuses to start (exit 2, naming the providers) or, with --allow-cpu-fallback, says so and uses
    the CPU. Scorers without OCR get `devices` as they are."""
    from megatron_omni.reward.registry import scorer_names

    try:
        names = scorer_names(scorer)
    except RewardInputError as exc:
        _fail(str(exc))
    if "ocr" not in names:
        return devices  # only rapidocr runs on onnxruntime (vlm_ocr reads through an HTTP endpoint)
    from megatron_omni.reward.ocr import missing_accelerator

    out = []
    for device in devices:
        missing = missing_accelerator(device)
        if missing is None:
            out.append(device)
        elif allow_cpu_fallback:
            print(f"reward server: CPU FALLBACK for {device}: {missing.split(' (install')[0]}; scoring on the CPU "
                  "(--allow-cpu-fallback)", file=sys.stderr, flush=True)
            out.append("cpu")
        else:
            _fail(missing)
    return out


def parse_cpu_list(spec: str) -> set[int]:
    """'2-5,7' -> {2, 3, 4, 5, 7}; every CPU must be one this process may run on."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"--cpus {spec!r}: expected CPU numbers like '1' or '2-5,7'")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"--cpus {spec!r}: CPUs {sorted(cpus - allowed)} are not available (have {sorted(allowed)})")
    return cpus


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m megatron_omni.reward.server`."""
    cfg, port_file = parse_args(argv)
    asyncio.run(serve(cfg, port_file))


if __name__ == "__main__":
    main()
