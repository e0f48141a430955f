"""The trainer's client of the reward server: submit each image as soon as it exists, gather in order.

Two faces over one implementation:
- `AsyncRewardClient`, for code already running an event loop:
      client.submit(i, image, prompt)      # schedules the HTTP request now, returns at once
      rewards = await client.gather()      # rewards[i] for i in 0..n-1, in sample order
      client.last_details                  # per sample: {"reward", "terms", "failed", "weights"} of that gather
- `RewardClient`, for the (blocking, torch-bound) rollout loop: the same API, with the event loop in a
  background thread so requests go out while the caller keeps generating.

Each sample has a deadline of `timeout_s` from submission. Within it the client retries with exponential
backoff (and jitter) on 429/503/504 and on connection errors (a server restarting, a dropped keep-alive
connection). When the deadline passes, or the server answers 4xx/500, gather() raises RewardServiceError
naming the URL, the sample and the last error: a dead server is detected within the timeout, never waited
on forever, and never turned into a reward of 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np

from megatron_omni.reward.errors import RewardServiceError
from megatron_omni.reward.images import ImageLike, encode_png_b64

RETRY_STATUSES = frozenset({429, 503, 504})


class AsyncRewardClient:
    """Async client of one reward server (`url` like "http://127.0.0.1:8000")."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        max_connections: int = 64,
    ):
        if timeout_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("need timeout_s > 0 and 0 < backoff_s <= max_backoff_s")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = float(timeout_s)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_connections = int(max_connections)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[int, asyncio.Task] = {}
        self._gathering: list[asyncio.Task] = []
        self._prefix = uuid.uuid4().hex[:12]
        self._seq = 0
        self.retries = 0  # attempts that were retried (for metrics)
        # Per sample of the last gather(): {"reward", "terms": {term: reward}, "failed": {term: message},
        # "weights": {term: w}} (terms empty for a single plain scorer).
        self.last_details: list[dict[str, Any]] = []

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=self.max_connections)
            )
        return self._session

    async def close(self) -> None:
        """Cancel outstanding samples and close connections."""
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self, timeout_s: float = 5.0) -> dict:
        """The server's /health body; RewardServiceError when unreachable or not ready."""
        try:
            async with self._get_session().get(
                self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    raise RewardServiceError(f"reward server {self.url} not ready: {resp.status} {body}")
                return body
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RewardServiceError(
                f"reward server {self.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc

    async def score_one(
        self,
        image: ImageLike,
        prompt: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        label: str = "sample",
    ) -> float:
        """Reward of one image, with retries until the deadline; RewardServiceError on failure."""
        return (await self.score_one_details(image, prompt, metadata, label=label))["reward"]

    async def score_one_details(
        self,
        image: ImageLike,
        prompt: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        label: str = "sample",
    ) -> dict[str, Any]:
        """{"reward", "terms", "failed", "weights"} of one image (see last_details), with retries until the
        deadline; RewardServiceError on failure."""
        deadline = time.monotonic() + self.timeout_s
        self._seq += 1
        item_id = f"{self._prefix}-{self._seq}"
        # Encoding errors (wrong image type) are the caller's bug: let RewardInputError through as is.
        body = {
            "items": [
                {
                    "id": item_id,
                    "image": encode_png_b64(image),
                    "prompt": prompt,
                    "metadata": dict(metadata or {}),
                }
            ]
        }
        attempt = 0
        last = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RewardServiceError(
                    f"reward server {self.url} gave no reward for {label} within {self.timeout_s:g} s "
                    f"({attempt} attempts); last error: {last}"
                )
            retry_hint = 0.0
            try:
                async with self._get_session().post(
                    self.url + "/score", json=body, timeout=aiohttp.ClientTimeout(total=remaining)
                ) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status == 200:
                        if data.get("ids") != [item_id] or len(data.get("rewards", [])) != 1:
                            raise RewardServiceError(
                                f"reward server {self.url} answered {label} with ids {data.get('ids')!r}, "
                                f"expected [{item_id!r}]"
                            )
                        return {"reward": float(data["rewards"][0]),
                                "terms": dict((data.get("terms") or [{}])[0]),
                                "failed": dict((data.get("failed") or [{}])[0]),
                                "weights": dict(data.get("weights") or {})}
                    message = data.get("error", data) if isinstance(data, dict) else data
                    if resp.status not in RETRY_STATUSES:
                        raise RewardServiceError(
                            f"reward server {self.url} refused {label}: {resp.status} {message}"
                        )
                    last = f"{resp.status} {message}"
                    retry_hint = float(data.get("retry_after_s") or resp.headers.get("Retry-After") or 0.0)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                last = f"no answer within the remaining {remaining:.3g} s"
                continue  # the loop head raises with the deadline message
            attempt += 1
            self.retries += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt - 1, 30))
            delay = max(delay * (0.5 + 0.5 * random.random()), min(retry_hint, self.max_backoff_s))
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))

    def submit(
        self, index: int, image: ImageLike, prompt: str, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Start scoring sample `index` now (must be called with the event loop running).

        The image is PNG-encoded by the request task; arrays are copied first, PIL images must not be
        modified after submission.
        """
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"sample index must be a non-negative int, got {index!r}")
        if index in self._tasks:
            raise ValueError(f"sample {index} was already submitted")
        if isinstance(image, np.ndarray):
            image = image.copy()  # encoded later; the caller may reuse its buffer for the next sample
        self._tasks[index] = asyncio.get_running_loop().create_task(
            self.score_one_details(image, prompt, metadata, label=f"sample {index}")
        )

    async def gather(self) -> list[float]:
        """Rewards of all submitted samples, in index order (indices must be 0..n-1); then resets.

        Raises RewardServiceError on the first failed sample (the others are cancelled).
        """
        tasks, self._tasks = self._tasks, {}
        n = len(tasks)
        if sorted(tasks) != list(range(n)):
            for t in tasks.values():
                t.cancel()
            missing = sorted(set(range(max(tasks, default=-1) + 1)) - set(tasks))
            raise ValueError(f"submitted sample indices are not 0..{n - 1}; missing {missing[:10]}")
        order = [tasks[i] for i in range(n)]
        self._gathering = order
        try:
            self.last_details = list(await asyncio.gather(*order))
            return [d["reward"] for d in self.last_details]
        except RewardServiceError as exc:
            left = self.outstanding
            await self._cancel(order)
            raise RewardServiceError(f"{exc} [{left} of {n} requests outstanding]") from exc
        except BaseException:
            await self._cancel(order)
            raise
        finally:
            self._gathering = []

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task]) -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet answered (those being gathered and those not gathered yet)."""
        return sum(not t.done() for t in [*self._gathering, *self._tasks.values()])

    async def score(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[float]:
        """Rewards of a whole batch (each image its own request, all concurrent), in order."""
        if len(prompts) != len(images) or (metadata is not None and len(metadata) != len(images)):
            raise ValueError("images, prompts and metadata must have the same length")
        metadata = metadata or [None] * len(images)
        return list(
            await asyncio.gather(
                *(
                    self.score_one(im, p, m, label=f"sample {i}")
                    for i, (im, p, m) in enumerate(zip(images, prompts, metadata))
                )
            )
        )


class RewardClient:
    """Blocking facade of AsyncRewardClient; its event loop runs in a daemon thread.

    `submit` returns immediately (the request is sent by the background loop while the caller keeps
    computing); `gather` blocks until every submitted sample has its reward, or raises.
    """

    def __init__(self, url: str, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()
        self._client = self._call(self._make(url, kwargs))

    @staticmethod
    async def _make(url: str, kwargs: dict) -> AsyncRewardClient:
        return AsyncRewardClient(url, **kwargs)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def url(self) -> str:
        """Server URL."""
        return self._client.url

    @property
    def retries(self) -> int:
        """Retried attempts so far."""
        return self._client.retries

    def submit(
        self, index: int, image: ImageLike, prompt: str, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """Start scoring sample `index`; returns at once."""

        async def _submit() -> None:
            self._client.submit(index, image, prompt, metadata)

        asyncio.run_coroutine_threadsafe(_submit(), self._loop).result()

    def gather(self, on_wait: Callable[[int], None] | None = None, poll_s: float = 0.5) -> list[float]:
        """Rewards of the submitted samples in index order; RewardServiceError on failure (naming the URL, the
        sample and how many requests were outstanding). While it waits, `on_wait(outstanding)` is called every
        `poll_s` seconds from this thread (a progress bar's postfix), and `on_wait(0)` once at the end."""
        future = asyncio.run_coroutine_threadsafe(self._client.gather(), self._loop)
        try:
            while True:
                try:
                    return future.result(timeout=poll_s)
                except concurrent.futures.TimeoutError:
                    if on_wait is not None:
                        on_wait(self._client.outstanding)
        finally:
            if on_wait is not None:
                on_wait(0)

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet answered."""
        return self._client.outstanding

    @property
    def last_details(self) -> list[dict[str, Any]]:
        """Per sample of the last gather: {"reward", "terms", "failed", "weights"}."""
        return self._client.last_details

    def score(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[float]:
        """Rewards of a batch, in order."""
        return self._call(self._client.score(images, prompts, metadata))

    def health(self, timeout_s: float = 5.0) -> dict:
        """The server's /health body."""
        return self._call(self._client.health(timeout_s))

    def close(self) -> None:
        """Close connections and stop the background loop."""
        if self._loop.is_closed():
            return
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
