"""The VLM-judge OCR reader against a small local OpenAI-compatible endpoint started by the test.

The endpoint is the only fake in the reward tests (no VLM runs on CPU). It checks each request the way
vLLM's OpenAI server would parse it (model, messages, an image_url part holding a base64 PNG data URL, a
text part) and answers like an instruction-tuned VLM: the transcription, sometimes wrapped in quotes, a
code fence or a reasoning block, "<none>" for an image without text. Which text is in which image it
knows from the test (keyed by the pixels it decodes), so the reward computed from its answers is known.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import threading

import numpy as np
import pytest
from aiohttp import web
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.errors import RewardScorerError
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.reward.registry import build_scorer
from megatron_omni.reward.vlm_judge import NO_TEXT, parse_answer

MODEL = "Qwen3-VL-8B-Instruct"
API_KEY = "judge-key"


def render(text: str, shade: int = 0) -> Image.Image:
    img = Image.new("RGB", (128, 48), (255, 255, 255))
    ImageDraw.Draw(img).text((6, 12), text, fill=(shade, 0, 0), font=ImageFont.truetype("DejaVuSans.ttf", 20))
    return img


def pixel_key(img: Image.Image) -> str:
    return hashlib.sha256(np.asarray(img.convert("RGB")).tobytes()).hexdigest()


class FakeJudge:
    """aiohttp OpenAI-compatible /v1/chat/completions in a background thread."""

    def __init__(self) -> None:
        self.answers: dict[str, str | int] = {}  # pixel key -> reply text, or an HTTP status to fail with
        self.requests: list[dict] = []
        self.problems: list[str] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _check(self, request: web.Request, body: dict) -> Image.Image | None:
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            self.problems.append("missing bearer key")
        if body.get("model") != MODEL:
            self.problems.append(f"model {body.get('model')!r}")
        msgs = body.get("messages")
        if not (isinstance(msgs, list) and len(msgs) == 1 and msgs[0].get("role") == "user"):
            self.problems.append("messages must be one user message")
            return None
        parts = msgs[0].get("content")
        kinds = [p.get("type") for p in parts] if isinstance(parts, list) else None
        if kinds != ["image_url", "text"] or not parts[1].get("text"):
            self.problems.append(f"content parts {kinds}")
            return None
        url = parts[0]["image_url"]["url"]
        prefix = "data:image/png;base64,"
        if not url.startswith(prefix):
            self.problems.append(f"image url {url[:40]!r}")
            return None
        return Image.open(io.BytesIO(base64.b64decode(url[len(prefix) :], validate=True)))

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        img = self._check(request, body)
        if img is None:
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        answer = self.answers.get(pixel_key(img), NO_TEXT)
        if isinstance(answer, int):
            return web.json_response({"error": {"message": "engine overloaded"}}, status=answer)
        if answer == "NO_CHOICES":
            return web.json_response({"id": "x", "object": "chat.completion", "choices": []})
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": MODEL,
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}
                ],
                "usage": {"prompt_tokens": 300, "completion_tokens": 5, "total_tokens": 305},
            }
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def start(self) -> FakeJudge:
        self._thread.start()
        assert self._ready.wait(10), "fake judge did not start"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def reward_fake_judge():
    judge = FakeJudge().start()
    yield judge
    judge.stop()


def test_parse_answer_variants() -> None:
    def body(content):
        return {"choices": [{"message": {"role": "assistant", "content": content}}]}

    assert parse_answer(body("HELLO")) == "HELLO"
    assert parse_answer(body('  "OPEN 24H"\n')) == "OPEN 24H"
    assert parse_answer(body("```\nSALE\n```")) == "SALE"
    assert parse_answer(body("<think>letters are large</think>\nWORLD")) == "WORLD"
    assert parse_answer(body("<none>")) == ""
    assert parse_answer(body([{"type": "text", "text": "AB"}, {"type": "text", "text": "C"}])) == "ABC"
    for bad in ({}, {"choices": []}, {"choices": [{"message": {}}]}, body(None)):
        with pytest.raises(RewardScorerError, match="VLM judge"):
            parse_answer(bad)


def test_vlm_judge_scores_through_the_chat_api(reward_fake_judge: FakeJudge) -> None:
    judge = reward_fake_judge
    imgs = [render("HELLO"), render("HELP"), render("WORLD", 1), render("", 2), render("OPEN 24H", 3)]
    replies = ["HELLO", "HELP", "```\nworld\n```", NO_TEXT, '<think>two words</think>"OPEN 24 H"']
    for im, reply in zip(imgs, replies):
        judge.answers[pixel_key(im)] = reply
    prompts = ['a sign "HELLO"', '"HELLO"', '"WORLD"', '"HELLO"', '"OPEN 24H"']
    n_before = len(judge.requests)
    scorer = build_scorer("vlm_ocr", base_url=judge.url, model=MODEL, api_key=API_KEY)
    assert scorer(imgs, prompts) == pytest.approx([1.0, 0.6, 1.0, 0.0, 1.0])
    assert not judge.problems, judge.problems
    sent = judge.requests[n_before:]
    assert len(sent) == len(imgs)
    assert all(r["temperature"] == 0.0 and r["max_tokens"] > 0 for r in sent)
    assert all("<none>" in r["messages"][0]["content"][1]["text"] for r in sent)
    # The same reader is reachable as the "ocr" scorer with reader="vlm".
    same = build_scorer("ocr", reader="vlm", base_url=judge.url, model=MODEL, api_key=API_KEY)
    assert same(imgs[:2], prompts[:2]) == pytest.approx([1.0, 0.6])


def test_vlm_judge_failures_raise(reward_fake_judge: FakeJudge) -> None:
    judge = reward_fake_judge
    failing, empty = render("FAIL", 4), render("NOCHOICE", 5)
    judge.answers[pixel_key(failing)] = 503
    judge.answers[pixel_key(empty)] = "NO_CHOICES"
    scorer = build_scorer("vlm_ocr", base_url=judge.url, model=MODEL, api_key=API_KEY)
    with pytest.raises(RewardScorerError, match="answered 503.*overloaded"):
        scorer([render("HELLO"), failing], ['"HELLO"', '"FAIL"'])
    with pytest.raises(RewardScorerError, match="no choices"):
        scorer([empty], ['"NOCHOICE"'])
    dead = build_scorer("vlm_ocr", base_url="http://127.0.0.1:9/v1", model=MODEL, timeout_s=2)
    with pytest.raises(RewardScorerError, match="unreachable"):
        dead([render("HELLO")], ['"HELLO"'])


def test_vlm_judge_behind_the_reward_server(reward_fake_judge: FakeJudge) -> None:
    judge = reward_fake_judge
    img = render("SERVED", 6)
    judge.answers[pixel_key(img)] = "SERVD"
    kwargs = {"base_url": judge.url, "model": MODEL, "api_key": API_KEY}
    with (
        RewardServerProcess("vlm_ocr", scorer_kwargs=kwargs) as srv,
        RewardClient(srv.url, timeout_s=30) as c,
    ):
        assert srv.health()["scorer"] == "ocr[vlm]"
        assert c.score([img], ['"SERVED"']) == pytest.approx([1 - 1 / 6])
    assert not judge.problems, judge.problems
