"""Architecture rules that reviewers would otherwise have to remember: lower rooms never import higher ones
(LAYER_ORDER is the order), device and backend names live only in megatron_omni/parallel/, and the package
never imports tests, examples, benchmarks or tools.

Each rule is a detector function run over the library's files; the detector tests plant an offender and
require the same function to flag it, so a detector that flags nothing fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_DIRS = ("megatron_omni", "model_providers")
BACKEND_LITERALS = {"cuda", "nccl", "gloo"}
# Lower rooms must not import higher ones. The planner is a pure cost model over layouts, shapes and the
# bridge's plan: the trainer (its JobConfig adapter) and the entry point read it, nothing below does.
LAYER_ORDER = ["algorithms", "parallel", "models", "model_providers", "checkpoint", "bridge", "rollout",
               "reward", "planner", "trainer"]
# Never imported by the library: what runs it or tests it.
OUTSIDE = ("tests", "examples", "benchmarks", "tools")


def _library_files() -> list[Path]:
    return [p for d in LIBRARY_DIRS for p in (ROOT / d).rglob("*.py")]


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def backend_literals(code: str, rel: str) -> list[str]:
    """`rel:line: 'name'` for every device/backend string literal in `code`."""
    return [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(ast.parse(code, filename=rel))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and (n.value.lower() in BACKEND_LITERALS or re.fullmatch(r"cuda:\d+", n.value))]


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "model_providers":
        return "model_providers"
    if parts[0] == "megatron_omni" and len(parts) > 1 and parts[1] in LAYER_ORDER:
        return parts[1]
    return None


def upward_imports(code: str, module: str) -> list[str]:
    """`line: room imports name` for every import in `code` (the source of `module`) that points to a higher
    room, or out of the library (tests, examples, benchmarks, tools)."""
    own = _layer_of(module)
    offenders = []
    for line, name in _imported_modules(ast.parse(code)):
        target = _layer_of(name)
        if own is not None and target and LAYER_ORDER.index(target) > LAYER_ORDER.index(own):
            offenders.append(f"{line}: {own} imports {name}")
        if name.split(".")[0] in OUTSIDE:
            offenders.append(f"{line}: {module} imports {name} (outside the library)")
    return offenders


def test_backend_names_only_in_parallel() -> None:
    offenders = []
    for path in _library_files():
        rel = path.relative_to(ROOT)
        if rel.parts[:2] != ("megatron_omni", "parallel"):
            offenders += backend_literals(path.read_text(), str(rel))
    assert not offenders, "device/backend names outside megatron_omni/parallel/:\n" + "\n".join(offenders)


def test_imports_point_downward_and_stay_in_the_library() -> None:
    offenders = []
    for path in _library_files():
        rel = path.relative_to(ROOT)
        offenders += [f"{rel}:{o}" for o in upward_imports(path.read_text(), ".".join(rel.with_suffix("").parts))]
    assert not offenders, "imports pointing upward or out of the library:\n" + "\n".join(offenders)


def test_every_room_of_the_package_is_in_the_order() -> None:
    rooms = {p.name for p in (ROOT / "megatron_omni").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms <= set(LAYER_ORDER), f"rooms missing from LAYER_ORDER: {sorted(rooms - set(LAYER_ORDER))}"


def test_detector_catches_a_literal() -> None:
    assert sorted(backend_literals('x = torch.zeros(1, device="cuda")\ny = "cuda:3"\nz = "CUDA-free"\n', "m.py")) == [
        "m.py:1: 'cuda'", "m.py:2: 'cuda:3'"]


def test_detector_catches_upward_and_outside_imports() -> None:
    code = ("import torch\nfrom megatron_omni.algorithms import loss\nfrom megatron_omni.trainer.config import X\n"
            "import megatron_omni.planner.plan\nfrom tests.distributed.harness import RankPool\n")
    assert upward_imports(code, "megatron_omni.rollout.engine") == [
        "3: rollout imports megatron_omni.trainer.config", "4: rollout imports megatron_omni.planner.plan",
        "5: megatron_omni.rollout.engine imports tests.distributed.harness (outside the library)"]
    assert upward_imports("from megatron_omni.planner import plan\n", "megatron_omni.trainer.dry_run") == []
    assert upward_imports("from megatron_omni.trainer import run\n", "megatron_omni.planner.plan") == [
        "1: planner imports megatron_omni.trainer"]


def test_benchmarks_tools_and_examples_import_nothing_from_tests() -> None:
    """What users run (benchmarks, tools, recipes) must work from the package alone: test helpers they need
    belong in the package (e.g. `megatron_omni.parallel.rank_pool`)."""
    pattern = re.compile(r"^\s*(from|import)\s+tests(\.|\s|$)", re.M)
    offenders = [str(p.relative_to(ROOT)) for room in ("benchmarks", "tools", "examples")
                 for p in sorted((ROOT / room).rglob("*.py")) if pattern.search(p.read_text())]
    assert not offenders, f"import from tests/: {offenders}"
    assert pattern.search("from tests.distributed.harness import run_ranks\n")  # the detector itself
