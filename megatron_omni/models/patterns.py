"""Module-name patterns (fnmatch, case-sensitive) that LoRA targets and quantized-linear lists are written in.

Apart from `models.lora` because it imports nothing heavy: the rollout's quantization spec runs in vLLM-Omni's
worker processes, which must not import megatron-core for two string helpers."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    """Whether module name `name` matches one of the fnmatch `patterns` (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def unmatched_targets(targets: Sequence[str], module_names: Iterable[str]) -> list[str]:
    """The patterns of `targets` that match none of `module_names`."""
    names = list(module_names)
    return [t for t in targets if not any(fnmatch.fnmatchcase(n, t) for n in names)]
