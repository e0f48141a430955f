"""AR-DiT checkpoint conversion: HF folder -> Megatron distributed checkpoint -> HF folder is bit-exact, and
bad input fails with a message and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "checkpoint" / "convert_ar_dit.py"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out[f"{f.parent.name}/{k}"] = v
    return out


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    hf, mcore, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    script = (
        "import sys; sys.argv=['x']; from tools.checkpoint import convert_ar_dit as c;"
        f"assert c.main(['make-tiny', '{hf}']) == 0;"
        f"assert c.main(['hf-to-mcore', '{hf}', '{mcore}']) == 0;"
        f"assert c.main(['mcore-to-hf', '{mcore}', '{back}']) == 0;"
        f"assert c.main(['mcore-to-hf', '{tmp_path / 'nope'}', '{tmp_path / 'x'}']) == 2"
    )
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", f"if True:\n    {script}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _tensors(hf), _tensors(back)
    assert set(a) == set(b) and len(a) > 40
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert not (tmp_path / "x").exists(), "a failed conversion left output behind"
    assert (mcore / "metadata.json").is_file()
    for folder in (hf, back):  # servable by vLLM-Omni (the hybrid DiT pipeline class) as written
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == "FlowGRPOHybridDiTPipeline", index
        assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"], index
