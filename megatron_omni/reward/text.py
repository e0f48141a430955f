"""The OCR reward's text side: which text a prompt asks for, and how close the read text is to it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rapidfuzz.distance import Levenshtein

from megatron_omni.reward.errors import RewardInputError

# Straight quotes are the flow_grpo convention ('A sign that says "OPEN"'); curly quotes are accepted
# because prompt files written in editors often contain them.
_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')


def normalize_text(text: str) -> str:
    """Lower-case and drop spaces (what flow_grpo and VeRL-Omni compare)."""
    return text.replace(" ", "").lower()


def target_from_prompt(prompt: str) -> str:
    """The text a prompt asks to render: its first double-quoted span ('... "HELLO" ...' -> 'HELLO').

    Raises RewardInputError when the prompt quotes nothing or only an empty/blank string.
    """
    if not isinstance(prompt, str):
        raise RewardInputError(f"prompt must be a string, got {type(prompt).__name__}")
    match = _QUOTED.search(prompt)
    if match is None:
        raise RewardInputError(
            f"prompt {prompt!r} quotes no text to render; quote it (\"...\") or pass metadata['target']"
        )
    target = match.group(1) if match.group(1) is not None else match.group(2)
    if not normalize_text(target):
        raise RewardInputError(f"prompt {prompt!r} quotes an empty text")
    return target


def resolve_target(prompt: str, metadata: Mapping[str, Any] | None) -> str:
    """metadata['target'] when given (explicit wins), else the quoted text of the prompt."""
    if metadata and "target" in metadata:
        target = metadata["target"]
        if not isinstance(target, str) or not normalize_text(target):
            raise RewardInputError(f"metadata['target'] must be a non-blank string, got {target!r}")
        return target
    return target_from_prompt(prompt)


def ocr_similarity(read: str, target: str) -> float:
    """`1 - min(lev(read, target), len(target)) / len(target)` on normalised texts; 1 if target is in read.

    Both texts are lower-cased and stripped of spaces first. The result is in [0, 1]; nothing read gives 0.
    """
    t = normalize_text(target)
    if not t:
        raise RewardInputError(f"target text {target!r} is blank")
    r = normalize_text(read)
    if t in r:
        return 1.0
    dist = min(Levenshtein.distance(r, t), len(t))
    return 1.0 - dist / len(t)
