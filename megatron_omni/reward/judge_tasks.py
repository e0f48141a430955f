"""What a VLM judge is asked, in which form it must answer, and the strict parse of that answer.

Each `JudgeTask` is a prompt template plus the answer's form written twice: as a JSON schema (checked on every
answer with `jsonschema`, and sent as OpenAI's `response_format` when asked) and as a regular expression of the
exact JSON text (sent as vLLM's `structured_outputs.regex`, the default). The regex pins the whitespace too:
a JSON-schema grammar lets a weak model emit spaces until `max_tokens` (a random tiny model did exactly that),
while the regex leaves it only the tokens of a complete answer. With either constraint a judge answers in the
parseable form; without one (`constraint="none"`) an answer that is not that JSON raises RewardScorerError
naming the text, never a default score.

Tasks (the UnifiedReward-style set, plus the GenEval questions):
- `ocr`: {"text": "<transcription>"} (at most `max_chars` characters, JSON escapes allowed);
- `alignment`: {"score": 1..5} how well the image matches the prompt;
- `pairwise`: {"preferred": 1 | 2} which of two images matches the prompt better;
- `count`, `color`, `relation`: GenEval's questions about one object class (geneval.py builds them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from megatron_omni.reward.errors import RewardInputError, RewardScorerError

CONSTRAINTS = ("regex", "json_schema", "none")
# GenEval's colour names (its `colors` task); the `color` answer is one of them.
GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
# GenEval's relations (its `position` task: "left of", "right of", "above", "below").
GENEVAL_RELATIONS = ("left of", "right of", "above", "below")
MAX_COUNT = 9


@dataclass(frozen=True)
class JudgeTask:
    """One question form: `instruction` (a str.format template), the answer `schema` and `regex`, and the key
    of the answer's value."""

    name: str
    instruction: str
    schema: dict[str, Any]
    regex: str
    key: str
    images: int = 1
    # Room for the longest answer (tokens; a byte-level tokenizer spends one per character).
    max_tokens: int = 32
    _validator: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_validator", jsonschema.Draft202012Validator(self.schema))

    def text(self, **fields: str) -> str:
        """The instruction with its fields filled in (RewardInputError naming a missing field)."""
        try:
            return self.instruction.format(**fields)
        except KeyError as exc:
            raise RewardInputError(f"judge task {self.name!r} needs {exc.args[0]!r} to build its question") from None

    def constraint_fields(self, constraint: str) -> dict[str, Any]:
        """The request fields that constrain the answer: vLLM's `structured_outputs` (regex), OpenAI's
        `response_format` (JSON schema), or nothing."""
        if constraint == "regex":
            return {"structured_outputs": {"regex": self.regex}}
        if constraint == "json_schema":
            return {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": self.name, "schema": self.schema, "strict": True}}}
        if constraint == "none":
            return {}
        raise RewardInputError(f"judge constraint {constraint!r}: expected one of {', '.join(CONSTRAINTS)}")

    def parse(self, content: str) -> Any:
        """The answer's value from the judge's message text: exactly one JSON object valid under the schema.
        RewardScorerError naming the text otherwise (no stripping, no guessing)."""
        try:
            data = json.loads(content)
        except (TypeError, ValueError) as exc:
            raise RewardScorerError(f"VLM judge answer to {self.name!r} is not JSON: {content[:300]!r}") from exc
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(data))
        if error is not None:
            raise RewardScorerError(f"VLM judge answer to {self.name!r} does not match its schema "
                                    f"({error.message}): {content[:300]!r}")
        return data[self.key]


def _object(key: str, value_schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {key: value_schema}, "required": [key], "additionalProperties": False}


def _alternatives(words: tuple[str, ...]) -> str:
    return "(" + "|".join(re.escape(w) for w in words) + ")"


def ocr_task(max_chars: int = 64) -> JudgeTask:
    """Transcription: {"text": "..."} of at most `max_chars` characters (a JSON escape counts as one)."""
    char = r'([^"\\\x00-\x1f]|\\["\\/bfnrt])'
    return JudgeTask(
        name="ocr",
        instruction=("Transcribe all text visible in this image exactly as written, in reading order. Answer with "
                     'the JSON object {{"text": "<the text>"}}, with an empty string if there is no text.'),
        schema=_object("text", {"type": "string", "maxLength": int(max_chars)}),
        regex=r'\{"text": "' + char + "{0," + str(int(max_chars)) + r'}"\}',
        key="text",
        # every character may be a two-character escape, plus the JSON frame
        max_tokens=2 * int(max_chars) + 16,
    )


ALIGNMENT = JudgeTask(
    name="alignment",
    instruction=("You are given a text prompt and an image generated from it. Rate how well the image matches the "
                 "prompt (objects, attributes, counts, positions, text) on a scale from 1 (not at all) to 5 "
                 '(perfectly).\nPrompt: {prompt}\nAnswer with the JSON object {{"score": <1-5>}}.'),
    schema=_object("score", {"type": "integer", "minimum": 1, "maximum": 5}),
    regex=r'\{"score": [1-5]\}',
    key="score",
)

PAIRWISE = JudgeTask(
    name="pairwise",
    instruction=("You are given a text prompt and two images generated from it (Image 1 first, then Image 2). "
                 "Which image matches the prompt better and looks better?\nPrompt: {prompt}\n"
                 'Answer with the JSON object {{"preferred": 1}} or {{"preferred": 2}}.'),
    schema=_object("preferred", {"type": "integer", "enum": [1, 2]}),
    regex=r'\{"preferred": [12]\}',
    key="preferred",
    images=2,
)

COUNT = JudgeTask(
    name="count",
    instruction=("How many {noun} are there in this image? Count only clearly visible ones. Answer with the JSON "
                 f'object {{{{"count": <0-{MAX_COUNT}>}}}}.'),
    schema=_object("count", {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}),
    regex=r'\{"count": [0-' + str(MAX_COUNT) + r"]\}",
    key="count",
)

COLOR = JudgeTask(
    name="color",
    instruction=("What is the main colour of the {noun} in this image? Answer with the JSON object "
                 '{{"color": "<colour>"}}, the colour one of: ' + ", ".join(GENEVAL_COLORS) + "."),
    schema=_object("color", {"type": "string", "enum": list(GENEVAL_COLORS)}),
    regex=r'\{"color": "' + _alternatives(GENEVAL_COLORS) + r'"\}',
    key="color",
)

RELATION = JudgeTask(
    name="relation",
    instruction=("Is the {noun} {relation} the {other} in this image? Answer with the JSON object "
                 '{{"answer": "yes"}} or {{"answer": "no"}}.'),
    schema=_object("answer", {"type": "string", "enum": ["yes", "no"]}),
    regex=r'\{"answer": "(yes|no)"\}',
    key="answer",
)
