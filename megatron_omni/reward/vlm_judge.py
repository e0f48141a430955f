"""A VLM judge reached through an OpenAI-compatible chat-completions API, and the OCR reader built on it.

This is what `vllm serve Qwen2.5-VL-7B-Instruct` (or `python -m megatron_omni.reward.vllm_server`) exposes on
the reward GPUs: POST {base_url}/chat/completions with the images as base64 PNG data URLs and a question from
a `JudgeTask` (judge_tasks.py), the answer constrained by vLLM's structured outputs and parsed strictly.
Requests of a batch go out concurrently (the VLM server batches them itself). HTTP errors, timeouts,
answers without a message and answers not in the task's form raise RewardScorerError naming the text; they
never become a default score.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import aiohttp
from PIL import Image

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.images import encode_png_b64
from megatron_omni.reward.judge_tasks import CONSTRAINTS, JudgeTask, ocr_task

# One question: the images it shows (in order) and its text.
Question = tuple[Sequence[Image.Image], str]


def build_request(images: Sequence[Image.Image], text: str, *, model: str, task: JudgeTask, constraint: str,
                  max_tokens: int) -> dict[str, Any]:
    """The chat-completions JSON body of one question (OpenAI vision message format, greedy decoding)."""
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + encode_png_b64(im)}} for im in images
    ]
    parts.append({"type": "text", "text": text})
    return {
        "model": model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
        **task.constraint_fields(constraint),
    }


def message_text(body: Any, max_tokens: int) -> str:
    """choices[0].message.content of a chat-completions response; RewardScorerError when there is none or
    the answer was cut at `max_tokens`."""
    try:
        choice = body["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise RewardScorerError(f"VLM judge answer has no choices[0].message.content: {str(body)[:300]}") from exc
    if not isinstance(content, str):
        raise RewardScorerError(f"VLM judge message content is {type(content).__name__}, not text: {content!r:.300}")
    if choice.get("finish_reason") == "length":
        raise RewardScorerError(f"VLM judge answer was cut at max_tokens={max_tokens}: {content[:300]!r}")
    return content


class VlmJudgeClient:
    """Asks a VLM behind an OpenAI-compatible API (`base_url` ends in /v1) questions of `JudgeTask` forms."""

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0,
                 max_concurrency: int = 16, max_tokens: int | None = None, constraint: str = "regex"):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise RewardInputError(f"VLM judge base_url must be an http(s) URL, got {base_url!r}")
        if not model:
            raise RewardInputError("VLM judge needs `model`: the name the vLLM server serves (--served-model-name)")
        if constraint not in CONSTRAINTS:
            raise RewardInputError(f"VLM judge constraint {constraint!r}: expected one of {', '.join(CONSTRAINTS)}")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.max_tokens = max_tokens  # None: each task's own bound
        self.constraint = constraint

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def check_served(self, timeout_s: float = 10.0) -> None:
        """GET {base_url}/models: RewardInputError naming the URL and the model expected when the server is
        unreachable or does not serve `model` (called before any scoring: a judge that is not there is refused
        at start, never scored as 0)."""
        request = urllib.request.Request(self.base_url + "/models", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                body = json.loads(resp.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RewardInputError(f"VLM judge at {self.base_url} is not answering ({type(exc).__name__}: {exc}); "
                                   f"expected an OpenAI-compatible server (vllm serve) serving {self.model!r}"
                                   ) from None
        served = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
        if self.model not in served:
            raise RewardInputError(f"VLM judge at {self.base_url} serves {served}, not the model {self.model!r} "
                                   "this scorer was given")

    async def _ask_one(self, session: aiohttp.ClientSession, sem: asyncio.Semaphore, question: Question,
                       task: JudgeTask) -> Any:
        images, text = question
        max_tokens = self.max_tokens or task.max_tokens
        body = build_request(images, text, model=self.model, task=task, constraint=self.constraint,
                             max_tokens=max_tokens)
        async with sem:
            try:
                async with session.post(self.url, json=body) as resp:
                    raw = await resp.text()
                    if resp.status != 200:
                        raise RewardScorerError(f"VLM judge at {self.url} answered {resp.status}: {raw[:300]}")
                    try:
                        data = json.loads(raw)
                    except ValueError as exc:
                        raise RewardScorerError(f"VLM judge at {self.url} sent invalid JSON: {raw[:300]}") from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise RewardScorerError(
                    f"VLM judge at {self.url} unreachable or timed out: {type(exc).__name__}: {exc}"
                ) from exc
        return task.parse(message_text(data, max_tokens))

    async def ask_async(self, questions: Sequence[Question], task: JudgeTask) -> list[Any]:
        """The parsed answers to `questions` (all of form `task`), concurrently, in order."""
        for images, _ in questions:
            if len(images) != task.images:
                raise RewardInputError(f"judge task {task.name!r} shows {task.images} image(s), got {len(images)}")
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        sem = asyncio.Semaphore(self.max_concurrency)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers()) as session:
            return list(await asyncio.gather(*(self._ask_one(session, sem, q, task) for q in questions)))

    def ask(self, questions: Sequence[Question], task: JudgeTask) -> list[Any]:
        """Blocking form of ask_async; safe to call from inside a running event loop (uses a thread)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ask_async(questions, task))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, self.ask_async(questions, task)).result()


class VlmJudgeReader:
    """OCR reader (`TextReader`): the judge transcribes each image as {"text": ...} (the `ocr` task)."""

    name = "vlm"

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 60.0,
                 max_concurrency: int = 16, max_chars: int = 64, constraint: str = "regex",
                 max_tokens: int | None = None, device: str | None = None):
        # `device` is accepted for a uniform worker interface: the judge runs in its own server.
        self.task = ocr_task(max_chars)
        self.client = VlmJudgeClient(base_url=base_url, model=model, api_key=api_key, timeout_s=timeout_s,
                                     max_concurrency=max_concurrency, max_tokens=max_tokens, constraint=constraint)

    def read(self, images: list[Image.Image]) -> list[str]:
        """One transcription per image ('' when the judge finds no text)."""
        return self.client.ask([([im], self.task.text()) for im in images], self.task)

    def warmup(self) -> None:
        """Refuse a judge server that is not there or serves another model (before any scoring)."""
        self.client.check_served()

    def close(self) -> None:
        """Sessions are per call: nothing to release."""
