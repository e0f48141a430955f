"""OCR text similarity and target extraction (megatron_omni/reward/text.py)."""

from __future__ import annotations

import random

import pytest

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.text import ocr_similarity, resolve_target, target_from_prompt


def _lev(a: str, b: str) -> int:
    """Textbook dynamic-programming edit distance, independent of rapidfuzz."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _reference(read: str, target: str) -> float:
    """flow_grpo's ocr.py reward, line by line."""
    prompt = target.replace(" ", "").lower()
    text = read.replace(" ", "").lower()
    dist = 0 if prompt in text else _lev(text, prompt)
    dist = min(dist, len(prompt))
    return 1 - dist / len(prompt)


@pytest.mark.parametrize(
    ("read", "target", "expected"),
    [
        ("HELLO", "hello", 1.0),
        ("H e L l O", "hello", 1.0),
        ("xx hello world", "Hello", 1.0),  # contained
        ("", "hello", 0.0),
        ("help", "hello", 0.6),  # two edits out of five
        ("HEL", "HELLO", 0.6),
        ("abcdefghij", "xy", 0.0),  # distance clamped to len(target)
        ("Hello World", "hello world", 1.0),
    ],
)
def test_similarity_cases(read: str, target: str, expected: float) -> None:
    assert ocr_similarity(read, target) == pytest.approx(expected, abs=1e-12)


def test_similarity_matches_reference_on_random_strings() -> None:
    rng = random.Random(0)
    alphabet = "abcAB C12"
    for _ in range(500):
        target = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
        if not target.replace(" ", ""):
            continue
        read = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        got = ocr_similarity(read, target)
        assert got == pytest.approx(_reference(read, target), abs=1e-12), (read, target)
        assert 0.0 <= got <= 1.0


def test_blank_target_raises() -> None:
    with pytest.raises(RewardInputError, match="blank"):
        ocr_similarity("abc", "  ")


def test_target_from_prompt() -> None:
    assert target_from_prompt('A neon sign that says "OPEN 24H" above a door') == "OPEN 24H"
    assert target_from_prompt('"first" and "second"') == "first"
    assert target_from_prompt("A poster reading \u201cSALE\u201d") == "SALE"
    with pytest.raises(RewardInputError, match="quotes no text"):
        target_from_prompt("a cat on a mat")
    with pytest.raises(RewardInputError, match="empty"):
        target_from_prompt('an empty sign ""')


def test_explicit_target_wins() -> None:
    assert resolve_target("a cat", {"target": "MEOW"}) == "MEOW"
    assert resolve_target('a sign "A"', {"target": "B"}) == "B"
    assert resolve_target('a sign "A"', {}) == "A"
    with pytest.raises(RewardInputError, match="target"):
        resolve_target('a sign "A"', {"target": 3})
