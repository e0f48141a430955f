"""A VLM judge as an OCR reader, reached through an OpenAI-compatible chat-completions API.

This is what `vllm serve Qwen3-VL-8B-Instruct` exposes on the reward GPUs: POST {base_url}/chat/completions
with the image as a base64 PNG data URL and an instruction to transcribe the text. Requests of a batch go
out concurrently (the VLM server batches them itself). HTTP errors, timeouts and answers without a
message raise RewardScorerError; they never become an empty read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from typing import Any

import aiohttp
from PIL import Image

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.images import encode_png_b64

DEFAULT_INSTRUCTION = (
    "Transcribe all text visible in this image exactly as written, in reading order. "
    "Answer with the text only, no explanation and no quotes. If there is no text, answer <none>."
)
NO_TEXT = "<none>"

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^```[a-zA-Z]*\n?(.*?)\n?```$", re.DOTALL)


def build_request(image: Image.Image, *, model: str, instruction: str, max_tokens: int) -> dict[str, Any]:
    """The chat-completions JSON body for one image (OpenAI vision message format)."""
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + encode_png_b64(image)},
                    },
                    {"type": "text", "text": instruction},
                ],
            }
        ],
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
    }


def parse_answer(body: Any) -> str:
    """The transcribed text from a chat-completions response body; '' when the judge says <none>.

    Strips reasoning blocks, code fences and one layer of surrounding quotes, which instruction-tuned
    VLMs add despite being told not to. Raises RewardScorerError when the body has no message text.
    """
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise RewardScorerError(
            f"VLM judge answer has no choices[0].message.content: {str(body)[:300]}"
        ) from exc
    if isinstance(content, list):  # some servers return content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise RewardScorerError(f"VLM judge message content is {type(content).__name__}, not text")
    text = _THINK.sub("", content).strip()
    fence = _FENCE.match(text)
    if fence:
        text = fence.group(1).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'`":
        text = text[1:-1].strip()
    if text.lower() == NO_TEXT:
        return ""
    return text


class VlmJudgeReader:
    """Reads text with a VLM behind an OpenAI-compatible API (`base_url` ends in /v1)."""

    name = "vlm"

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_concurrency: int = 16,
        max_tokens: int = 64,
        instruction: str = DEFAULT_INSTRUCTION,
        device: str | None = None,  # accepted for a uniform worker interface; the judge runs elsewhere
    ):
        if not base_url.startswith(("http://", "https://")):
            raise RewardInputError(f"VLM judge base_url must be an http(s) URL, got {base_url!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.max_concurrency = int(max_concurrency)
        self.max_tokens = int(max_tokens)
        self.instruction = instruction

    async def _read_one(
        self, session: aiohttp.ClientSession, sem: asyncio.Semaphore, image: Image.Image
    ) -> str:
        body = build_request(
            image, model=self.model, instruction=self.instruction, max_tokens=self.max_tokens
        )
        async with sem:
            try:
                async with session.post(self.url, json=body) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise RewardScorerError(
                            f"VLM judge at {self.url} answered {resp.status}: {text[:300]}"
                        )
                    try:
                        data = await resp.json(content_type=None)
                    except ValueError as exc:
                        raise RewardScorerError(
                            f"VLM judge at {self.url} sent invalid JSON: {text[:300]}"
                        ) from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise RewardScorerError(
                    f"VLM judge at {self.url} unreachable or timed out: {type(exc).__name__}: {exc}"
                ) from exc
        return parse_answer(data)

    async def read_async(self, images: list[Image.Image]) -> list[str]:
        """Concurrent transcriptions of `images`, in order."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        sem = asyncio.Semaphore(self.max_concurrency)
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            return list(await asyncio.gather(*(self._read_one(session, sem, im) for im in images)))

    def read(self, images: list[Image.Image]) -> list[str]:
        """Blocking form of read_async; safe to call from inside a running event loop (uses a thread)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.read_async(images))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, self.read_async(images)).result()

    def close(self) -> None:
        """Sessions are per call: nothing to release."""
