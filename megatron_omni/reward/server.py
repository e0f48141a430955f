"""The reward server: scorers in worker processes behind an aiohttp HTTP API.

    python -m megatron_omni.reward.server --scorer ocr [--host 127.0.0.1] [--port 8000] [--workers 1]
    python -m megatron_omni.reward.server --scorer pickscore@type:6,type:7 --scorer ocr@cpu \
        --reward "0.7*pickscore+0.3*ocr?" --scorer-kwargs '{"pickscore": {"model": "/models/PickScore_v1"}}'
    python -m megatron_omni.reward.server --config reward.json     # the same as a file (see load_config)
        [--devices type:0,type:1] [--max-queue 256] [--max-batch 16] [--batch-wait-ms 0] [--timeout 60]
        [--token T | env REWARD_SERVER_TOKEN] [--scorer-kwargs JSON] [--port-file PATH] [--cpus 1]

`--cpus` pins the server and its CPU workers to their own cores (the CPU form of "the reward on its own
GPUs"): without it, a rollout and an OCR worker on the same cores slow each other and overlap saves less.

API (JSON):
- GET /health -> 200 {"status": "ok", "scorer", "workers", "pending", "max_queue", "stats", "scorers": {name:
  {"ready", "devices", "error"}}, "terms": {term: {"weight", "required"}}} once every worker has built its
  scorer; 503 {"status": "starting", ...} before (each scorer's readiness shown).
- POST /score {"items": [{"id": any, "image": base64 PNG, "prompt": str, "metadata": {...}}, ...]}
  -> 200 {"ids": [...], "rewards": [...], "terms": [{term: reward}, ...], "failed": [{term: message}, ...],
  "weights": {term: w}} in item order: each reward is sum_k w_k * term_k over the terms that scored; a failed
  optional term is left out and named in "failed"; a failed required term answers 500.

Several scorers (`--scorer NAME@DEVICES` repeated, or a --config file) each get their own workers (one per
device of their list), queue and batches; every item goes to every scorer and the terms are combined with the
weights of `--reward` (default: each scorer with weight 1, required).
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

from megatron_omni.reward.errors import RewardInputError, RewardWeightsError
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
    # Several scorers, each on its own devices: {name: [device, ...]} (a device None: a CPU worker). Empty: the
    # one `scorer` above on `devices`/`workers`.
    scorers: dict[str, list[str | None]] = field(default_factory=dict)
    reward: str | None = None  # how the scorers' terms combine ("0.7*pickscore+0.3*ocr?"); None: each weight 1
    options: dict[str, dict] = field(default_factory=dict)  # per scorer name: constructor options


@dataclass
class _Group:
    """One scorer's workers and queue; `name` None for the single-scorer form (its own terms, if any)."""

    name: str | None
    workers: list[ScorerWorker]
    weight: float = 1.0
    required: bool = True
    queue: asyncio.Queue | None = None
    ready: bool = False
    error: str | None = None


@dataclass
class _Pending:
    png: bytes
    prompt: str
    metadata: dict
    future: asyncio.Future
    left: list[int] | None = None  # groups yet to take the item (shared by its copies); pending drops at 0


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
        self.cfg = cfg
        self.groups = self._groups(cfg)
        self.workers = [w for g in self.groups for w in g.workers]
        self.scorer_name: str | None = None
        self.ready = False
        self.fatal: str | None = None
        self.fatal_status = 1
        self.on_fatal: Callable[[], None] = lambda: None
        self.pending = 0
        self.stats = _Stats()
        self._tasks: list[asyncio.Task] = []
        self.app = web.Application(client_max_size=cfg.max_body_bytes)
        self.app.router.add_get("/health", self.handle_health)
        self.app.router.add_post("/score", self.handle_score)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    @staticmethod
    def _groups(cfg: ServerConfig) -> list[_Group]:
        if not cfg.scorers:
            devices = cfg.devices or [None] * cfg.workers
            if not devices:
                raise ValueError("need at least one worker or device")
            return [_Group(None, [ScorerWorker(cfg.scorer, cfg.scorer_kwargs, device=d, threads=cfg.threads,
                                               options=cfg.options) for d in devices])]
        from megatron_omni.reward.registry import parse_terms

        terms = parse_terms(cfg.reward) if cfg.reward else [(n, 1.0, True) for n in cfg.scorers]
        names = [t[0] for t in terms]
        if sorted(names) != sorted(cfg.scorers) or len(set(names)) != len(names):
            raise ValueError(f"--reward {cfg.reward!r} names the terms {names}, but the scorers served are "
                             f"{sorted(cfg.scorers)}: each scorer must be one term")
        groups = []
        for name, weight, required in terms:
            devices = cfg.scorers[name] or [None]
            workers = [ScorerWorker(name, dict(cfg.options.get(name, {})), device=d, threads=cfg.threads)
                       for d in devices]
            groups.append(_Group(name, workers, weight, required))
        return groups

    # ------------------------------------------------------------------ lifecycle

    async def _on_startup(self, app: web.Application) -> None:
        for g in self.groups:
            g.queue = asyncio.Queue()
        self._tasks.append(asyncio.create_task(self._start_workers()))

    async def _start_group(self, g: _Group) -> list[str]:
        try:
            names = await asyncio.gather(*(w.start() for w in g.workers))
        except BaseException as exc:
            g.error = f"{type(exc).__name__}: {exc}"
            raise
        g.ready = True
        return names

    async def _start_workers(self) -> None:
        try:
            names = await asyncio.gather(*(self._start_group(g) for g in self.groups))
        except BaseException as exc:
            # A scorer that cannot be built is fatal: exit rather than serve 503 forever; missing or foreign
            # weights exit 2 (as a bad config does), naming the path.
            which = self.cfg.scorer if not self.cfg.scorers else [g.name for g in self.groups if g.error]
            self.fatal = f"building scorer {which!r} failed: {type(exc).__name__}: {exc}"
            self.fatal_status = 2 if isinstance(exc, RewardWeightsError) else 1
            print(f"reward server: {self.fatal}", file=sys.stderr, flush=True)
            self.on_fatal()
            raise
        self.scorer_name = names[0][0] if not self.cfg.scorers else (self.cfg.reward or "+".join(self.cfg.scorers))
        for g in self.groups:
            for w in g.workers:
                self._tasks.append(asyncio.create_task(self._dispatch(w, g)))
        self.ready = True
        print(f"reward server: scorer {self.scorer_name} ready on {len(self.workers)} worker(s)", flush=True)

    def term_info(self) -> dict[str, dict[str, Any]]:
        """{term: {"weight", "required"}} of the combined reward (empty for a single plain scorer)."""
        if self.cfg.scorers:
            return {g.name: {"weight": g.weight, "required": g.required} for g in self.groups}
        info = self.groups[0].workers[0].info if self.ready else {}
        return {k: {"weight": w, "required": info["required"][k]} for k, w in info.get("weights", {}).items()}

    async def _on_cleanup(self, app: web.Application) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:
            w.stop()

    # ------------------------------------------------------------------ batching

    def _done(self, items: list[_Pending]) -> None:
        """An item leaves `pending` when the last of its groups has answered (or dropped) it."""
        for p in items:
            if p.left is None:
                self.pending -= 1
                continue
            p.left[0] -= 1
            if p.left[0] == 0:
                self.pending -= 1

    async def _dispatch(self, worker: ScorerWorker, group: _Group) -> None:
        queue = group.queue
        assert queue is not None
        while True:
            batch = [await queue.get()]
            if self.cfg.batch_wait_s > 0 and len(batch) < self.cfg.max_batch and queue.empty():
                await asyncio.sleep(self.cfg.batch_wait_s)
            while len(batch) < self.cfg.max_batch and not queue.empty():
                batch.append(queue.get_nowait())
            live = [p for p in batch if not p.future.done()]  # requests that timed out are dropped
            self._done([p for p in batch if p.future.done()])
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
            for p, r in zip(live, results):
                if not p.future.done():
                    p.future.set_result(r)
            self._done(live)

    def _retry_after_s(self) -> float:
        """Expected wait until the queue has drained by half (a hint, at least 50 ms)."""
        per_item = self.stats.busy_s / self.stats.items_scored if self.stats.items_scored else 0.05
        return max(0.05, 0.5 * self.pending * len(self.groups) * per_item / len(self.workers))

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
            "scorers": {(g.name or str(self.cfg.scorer)): {"ready": g.ready, "error": g.error,
                                                           "devices": [w.device or "cpu" for w in g.workers]}
                        for g in self.groups},
            "terms": self.term_info(),
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
        loop = asyncio.get_running_loop()
        per_group: list[list[_Pending]] = [[] for _ in self.groups]
        for _, png, prompt, meta in items:
            left = [len(self.groups)]
            for gi in range(len(self.groups)):
                per_group[gi].append(_Pending(png, prompt, meta, loop.create_future(), left))
        self.pending += n
        for g, pend in zip(self.groups, per_group):
            for p in pend:
                g.queue.put_nowait(p)  # type: ignore[union-attr]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(asyncio.gather(*(p.future for p in pend)) for pend in per_group)),
                self.cfg.timeout_s)
        except TimeoutError:
            self.stats.timed_out += 1
            for pend in per_group:  # the dispatchers drop them; pending falls as each is dropped
                for p in pend:
                    if not p.future.done():
                        p.future.cancel()
            return self._error(
                504, f"not scored within {self.cfg.timeout_s:g} s", retry_after_s=self._retry_after_s()
            )
        rewards, terms, failed = [], [], []
        for i in range(n):
            reward, t, f = 0.0, {}, {}
            for g, res in zip(self.groups, results):
                kind, value = res[i]
                label = self.scorer_name if g.name is None else g.name
                if kind == "input_error":
                    self.stats.bad_requests += 1
                    return self._error(422, f"items[{i}]: {value}")
                if kind != "ok" and g.required:
                    self.stats.errors += 1
                    return self._error(500, f"scorer {label} failed on items[{i}]: {value}")
                if kind != "ok":
                    f[g.name] = value
                    continue
                if isinstance(value, dict):  # a weighted sum in one worker: its own terms
                    t.update(value["terms"])
                    f.update(value["failed"])
                    value = value["reward"]
                elif g.name is not None:
                    t[g.name] = value
                reward += g.weight * value
            rewards.append(reward)
            terms.append(t)
            failed.append(f)
        self.stats.answered += 1
        return web.json_response({"ids": [it[0] for it in items], "rewards": rewards, "terms": terms,
                                  "failed": failed,
                                  "weights": {k: v["weight"] for k, v in self.term_info().items()}})


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
        raise SystemExit(server.fatal_status)  # the reason was printed when it happened


def parse_args(argv: list[str] | None = None) -> tuple[ServerConfig, str | None]:
    """CLI -> (ServerConfig, port_file)."""
    p = argparse.ArgumentParser(
        prog="python -m megatron_omni.reward.server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--scorer", action="append", default=None,
                   help="registered name, 'module:function', or '0.8*ocr+0.2*x'; or NAME@DEVICES (repeatable: "
                        "'pickscore@type:6,type:7', 'ocr@cpu'), one scorer each with its own workers")
    p.add_argument("--reward", default=None, help="with NAME@DEVICES scorers: how their terms combine "
                   "('0.7*pickscore+0.3*ocr?', a '?' marks an optional term); default each weight 1, required")
    p.add_argument("--config", default=None, help="a JSON file {\"reward\": spec, \"scorers\": {name: {\"devices\": "
                   "[...], \"kwargs\": {...}}}} instead of --scorer/--reward")
    p.add_argument("--scorer-kwargs", default="{}", help="JSON object of scorer constructor options (with several "
                   "scorers or a weighted spec: {name: options})")
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
    if bool(a.config) == bool(a.scorer):
        p.error("give --scorer (one or more) or --config, not both or neither")
    scorers, reward, options = _multi(a, kwargs) if a.config or any("@" in x for x in a.scorer) or \
        len(a.scorer) > 1 else ({}, None, {})
    scorer: Any = a.scorer[0] if a.scorer else None
    if scorers:
        kwargs = {}
    elif isinstance(scorer, str) and scorer.lstrip().startswith("{"):
        scorer = json.loads(scorer)
    elif isinstance(scorer, str) and kwargs and _per_name(scorer, kwargs):
        options, kwargs = kwargs, {}  # {name: options}: a weighted spec's terms, or the one scorer by name
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
    if devices and not scorers:
        devices = _ocr_devices(scorer, devices, a.allow_cpu_fallback)
    for name, devs in scorers.items():
        if name == "ocr" and any(devs):
            scorers[name] = _ocr_devices(name, [d or "cpu" for d in devs], a.allow_cpu_fallback)
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
        scorers=scorers,
        reward=reward,
        options=options,
    )
    return cfg, a.port_file


def _per_name(scorer: str, kwargs: dict) -> bool:
    """Whether --scorer-kwargs is {scorer name: options} for the names `scorer` uses (else: the options of the one
    scorer)."""
    from megatron_omni.reward.registry import scorer_names

    try:
        names = set(scorer_names(scorer))
    except RewardInputError:
        return False
    return all(isinstance(v, dict) for v in kwargs.values()) and set(kwargs) <= names


def _multi(a: argparse.Namespace, kwargs: dict) -> tuple[dict[str, list[str | None]], str | None, dict]:
    """({name: devices}, the --reward spec, {name: options}) of NAME@DEVICES scorers or a --config file; exits 2
    naming the problem (an unknown scorer, a weighted spec as one scorer, a config that is not as documented)."""
    from megatron_omni.reward.registry import scorer_names

    scorers: dict[str, list[str | None]] = {}
    options: dict[str, dict] = {k: dict(v) for k, v in kwargs.items() if isinstance(v, dict)}
    reward = a.reward
    if a.config:
        try:
            with open(a.config) as f:
                conf = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            _fail(f"--config {a.config}: {exc}")
        if not isinstance(conf, dict) or not isinstance(conf.get("scorers"), dict) or not conf["scorers"]:
            _fail(f"--config {a.config}: expected {{\"reward\": spec, \"scorers\": {{name: {{\"devices\": [...], "
                  "\"kwargs\": {...}}}}}")
        reward = reward or conf.get("reward")
        for name, entry in conf["scorers"].items():
            entry = entry or {}
            scorers[name] = [None if d in (None, "cpu") else d for d in entry.get("devices", ["cpu"])] or [None]
            options[name] = {**options.get(name, {}), **dict(entry.get("kwargs", {}))}
    for item in a.scorer or []:
        name, _, devs = item.partition("@")
        name = name.strip()
        if name in scorers:
            _fail(f"--scorer {item!r}: {name} is given twice (list its devices once: {name}@d0,d1)")
        scorers[name] = [None if d.strip() == "cpu" else d.strip() for d in devs.split(",") if d.strip()] or [None]
    for name in scorers:
        try:
            if scorer_names(name) != [name] or "+" in name or "*" in name:
                raise RewardInputError(f"{name!r} is not one scorer (combine several with --reward)")
        except RewardInputError as exc:
            _fail(f"--scorer {name}: {exc}")
    if reward:
        from megatron_omni.reward.registry import parse_terms

        try:
            names = [t[0] for t in parse_terms(reward)]
        except RewardInputError as exc:
            _fail(f"--reward {reward!r}: {exc}")
        if sorted(names) != sorted(scorers) or len(set(names)) != len(names):
            _fail(f"--reward {reward!r} names the terms {names}, but the scorers served are {sorted(scorers)}: "
                  "each scorer must be one term")
    return scorers, reward, options


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
