"""Scorers that ask a VLM judge (vlm_judge.VlmJudgeClient): `vlm_judge` / `unifiedreward` and `geneval`.

- `vlm_judge` (alias `unifiedreward`, the UnifiedReward-style judge): `task="alignment"` (default) asks for a
  1-5 score of how well the image matches the prompt, reward (score - 1) / 4 in [0, 1]; `task="pairwise"` shows
  the image and the prompt's reference image (metadata `reference_image`) and asks which is better, in both
  orders (the judge's position bias cancels), reward = the share of the two answers that prefer the sample
  (0, 0.5 or 1); `task="ocr"` is the OCR similarity of the judge's transcription (as `vlm_ocr`).
- `geneval`: GenEval's compositional checks as questions to the judge, from each prompt's GenEval metadata
  (`include`/`exclude` items with `class`, `count`, optional `color` and `position`): the object counts
  (at least `count` of each included class, fewer than `count` of each excluded one), the colours and the
  relative positions. Reward = the share of checks passed, or with `strict=True` GenEval's own per-image
  correctness (1 when every check passes, else 0). The original GenEval decides with an object detector
  (Mask2Former through mmdet), which is not a dependency here: this is the VLM-judge form of its questions.

Per-prompt metadata reaches a scorer with the request (the reward server's `metadata`), or from
`metadata_file`: a JSONL of objects with a `prompt` key (GenEval's `evaluation_metadata.jsonl` is one), looked
up by the prompt text; a prompt with neither is refused by name (RewardInputError), never scored 0. Relative
paths in metadata (`reference_image`) are taken from the metadata file's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.judge_tasks import (
    ALIGNMENT,
    COLOR,
    COUNT,
    GENEVAL_COLORS,
    GENEVAL_RELATIONS,
    PAIRWISE,
    RELATION,
    JudgeTask,
)
from megatron_omni.reward.scorers import Scorer
from megatron_omni.reward.vlm_judge import Question, VlmJudgeClient, VlmJudgeReader

TASKS = ("alignment", "pairwise", "ocr")


def load_metadata_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """prompt -> metadata from a JSONL file of objects with a `prompt` key (later lines win). RewardInputError
    naming the file and line when it is missing or a line is not such an object."""
    p = Path(path)
    if not p.is_file():
        raise RewardInputError(f"metadata_file {str(p)!r} is not a file (expected JSONL lines with a 'prompt' key)")
    out: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise RewardInputError(f"{p}:{n}: not JSON ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise RewardInputError(f"{p}:{n}: expected an object with a string 'prompt'")
        out[item["prompt"]] = {**item, "_base_dir": str(p.parent)}
    return out


class _JudgeScorer(Scorer):
    """Shared by the judge scorers: the client, the metadata lookup, the start-up check."""

    def __init__(self, *, base_url: str, model: str, metadata_file: str | None = None, **client_kwargs: Any):
        client_kwargs.pop("device", None)  # the judge runs in its own server
        self.client = VlmJudgeClient(base_url=base_url, model=model, **client_kwargs)
        self.by_prompt = load_metadata_file(metadata_file) if metadata_file else {}

    def metadata_for(self, prompt: str, given: dict[str, Any], needed: str) -> dict[str, Any]:
        """The request's metadata if it has `needed`, else the metadata file's entry for `prompt`."""
        if needed in given:
            return given
        if prompt in self.by_prompt:
            return self.by_prompt[prompt]
        raise RewardInputError(f"{self.name}: prompt {prompt!r} has no {needed!r} in its metadata and is not in the "
                               f"metadata_file ({len(self.by_prompt)} prompts)")

    def warmup(self) -> None:
        """Refuse a judge server that is not there or serves another model (before any scoring)."""
        self.client.check_served()


class VlmJudgeScorer(_JudgeScorer):
    """UnifiedReward-style judge: alignment score, pairwise preference or OCR transcription (see module doc)."""

    def __init__(self, *, base_url: str, model: str, task: str = "alignment", metadata_file: str | None = None,
                 **client_kwargs: Any):
        if task not in TASKS:
            raise RewardInputError(f"vlm_judge task {task!r}: expected one of {', '.join(TASKS)}")
        self.task = task
        self.name = f"vlm_judge[{task}]"
        if task == "ocr":
            from megatron_omni.reward.ocr import OcrScorer

            self.ocr = OcrScorer(reader=VlmJudgeReader(base_url=base_url, model=model, **client_kwargs))
            self.client = self.ocr.reader.client
            self.by_prompt = {}
            return
        super().__init__(base_url=base_url, model=model, metadata_file=metadata_file, **client_kwargs)

    def _reference(self, prompt: str, meta: dict[str, Any]) -> Image.Image:
        entry = self.metadata_for(prompt, meta, "reference_image")
        path = Path(entry["reference_image"])
        if not path.is_absolute():
            path = Path(entry.get("_base_dir", ".")) / path
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except OSError as exc:
            raise RewardInputError(f"{self.name}: reference_image {str(path)!r} of prompt {prompt!r} cannot be "
                                   f"read: {exc}") from None

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Reward per image in [0, 1]."""
        if self.task == "ocr":
            return self.ocr.score(images, prompts, metadata)
        if self.task == "alignment":
            scores = self.client.ask([([im], ALIGNMENT.text(prompt=p)) for im, p in zip(images, prompts)], ALIGNMENT)
            return [(s - 1) / 4.0 for s in scores]
        refs = [self._reference(p, m) for p, m in zip(prompts, metadata)]
        questions: list[Question] = []
        for im, ref, p in zip(images, refs, prompts):
            text = PAIRWISE.text(prompt=p)
            questions += [([im, ref], text), ([ref, im], text)]
        answers = self.client.ask(questions, PAIRWISE)
        return [((answers[2 * i] == 1) + (answers[2 * i + 1] == 2)) / 2.0 for i in range(len(images))]


def _noun(name: str, count: int) -> str:
    """GenEval's class names are singular ('dog', 'hair drier'): a crude plural for the count question."""
    return name if count == 1 else (name + "es" if name.endswith(("s", "sh", "ch", "x")) else name + "s")


def geneval_checks(meta: dict[str, Any]) -> list[tuple[JudgeTask, dict[str, str], Any]]:
    """GenEval metadata -> the questions that decide it: (task, template fields, the answer that passes; for a
    count a predicate). RewardInputError naming what is malformed."""
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        raise RewardInputError(f"geneval metadata needs a non-empty 'include' list, got {include!r}")
    checks: list[tuple[JudgeTask, dict[str, str], Any]] = []
    for where, items in (("include", include), ("exclude", meta.get("exclude") or [])):
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("class"), str) or \
                    not isinstance(item.get("count"), int):
                raise RewardInputError(f"geneval {where} item {item!r} needs a string 'class' and an int 'count'")
            need = item["count"]
            ok = (lambda n, need=need: n >= need) if where == "include" else (lambda n, need=need: n < need)
            checks.append((COUNT, {"noun": _noun(item["class"], 2)}, ok))
            if where == "exclude":
                continue
            if "color" in item:
                if item["color"] not in GENEVAL_COLORS:
                    raise RewardInputError(f"geneval colour {item['color']!r} is not one of {GENEVAL_COLORS}")
                checks.append((COLOR, {"noun": item["class"]}, item["color"]))
            if "position" in item:
                relation, other = item["position"]
                if relation not in GENEVAL_RELATIONS or not (0 <= int(other) < len(include)):
                    raise RewardInputError(f"geneval position {item['position']!r}: expected [one of "
                                           f"{GENEVAL_RELATIONS}, an index into include]")
                checks.append((RELATION, {"noun": item["class"], "relation": relation,
                                          "other": include[int(other)]["class"]}, "yes"))
    return checks


class GenEvalScorer(_JudgeScorer):
    """GenEval's checks asked of a VLM judge (see module doc)."""

    name = "geneval"

    def __init__(self, *, base_url: str, model: str, metadata_file: str | None = None, strict: bool = False,
                 **client_kwargs: Any):
        super().__init__(base_url=base_url, model=model, metadata_file=metadata_file, **client_kwargs)
        self.strict = bool(strict)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Share of GenEval checks passed per image (strict: 1 when all pass, else 0)."""
        per_image = [geneval_checks(self.metadata_for(p, m, "include")) for p, m in zip(prompts, metadata)]
        passed: list[list[bool]] = [[] for _ in images]
        for task in (COUNT, COLOR, RELATION):  # one concurrent batch per answer form
            where = [(i, fields, want) for i, checks in enumerate(per_image) for t, fields, want in checks
                     if t is task]
            if not where:
                continue
            answers = self.client.ask([([images[i]], task.text(**fields)) for i, fields, _ in where], task)
            for (i, _, want), got in zip(where, answers):
                passed[i].append(want(got) if callable(want) else got == want)
        if self.strict:
            return [float(all(p)) for p in passed]
        return [sum(p) / len(p) for p in passed]
