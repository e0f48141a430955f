"""The GPU image's install plan keeps one torch (no Docker here: pip resolves the plan from PyPI).

The Dockerfile installs torch/torchvision/torchaudio first, pins them with docker/constraints.txt as
PIP_CONSTRAINT, then installs this project with its `gpu` extra (vLLM, vLLM-Omni, ModelOpt) and compiles
TransformerEngine and apex against that torch without build isolation. Here `pip install --dry-run --report`
resolves `.[gpu]` under the same constraints file, ignoring what this venv has: it fails if any pinned
package needs another torch, and the plan must hold exactly the constrained versions (vllm==0.30.0 requires
them). This machine resolves for its own CPython (3.11, x86_64 Linux; the image runs 3.12): pip cannot
resolve cross-platform here because vLLM-Omni needs openai-whisper, which ships no wheel.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "docker" / "constraints.txt"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_dockerfile_installs_under_the_constraints() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY docker/constraints.txt /opt/megatron-omni/constraints.txt" in text
    assert "PIP_CONSTRAINT=/opt/megatron-omni/constraints.txt" in text
    assert 'pip install -e ".[gpu]"' in text
    pins = _pins(CONSTRAINTS)
    first = re.search(r'RUN pip install ("torch==[^\n]*)', text).group(1)
    assert first.rstrip(" \\").split() == [f'"{n}=={v}"' for n, v in pins.items()], first
    for step in ("transformer-engine[pytorch]", "APEX_CUDA_EXT=1"):  # compiled against the image's torch
        line = next(x for x in text.splitlines() if step in x and "pip install" in x)
        assert "--no-build-isolation" in line, line


@pytest.mark.slow
def test_gpu_install_plan_keeps_the_constrained_torch(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "-c", str(CONSTRAINTS), f"{ROOT}[gpu]"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"the image's install plan does not resolve under {CONSTRAINTS.name}:\n" \
                                 f"{proc.stderr[-4000:]}"
    plan = json.loads(report.read_text())["install"]
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in plan}
    for name, version in _pins(CONSTRAINTS).items():
        assert name in planned, f"{name} is not in the plan"
        assert planned[name].split("+")[0] == version, f"{name}: plan has {planned[name]}, image pins {version}"
    for name, version in (("vllm", "0.30.0"), ("vllm-omni", "0.30.0"), ("megatron-core", "0.16.1")):
        assert planned.get(name) == version, (name, planned.get(name))
