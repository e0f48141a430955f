"""tools/gpu_check_report.py: the GPU check's table names every check (those that did not run as such), and
its JSON is what `--dry-run --mfu-from` reads (the planner's `measured_mfu`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_omni.planner import measured_mfu

ROOT = Path(__file__).resolve().parents[2]
BLOCK = {f"batch_{b}": dict(block_ms=10.0 * b, tflops=400.0, mfu_790=0.506, mfu=0.404) for b in (1, 2, 4)}


def _report(tmp_path: Path, rows: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    figures, out = tmp_path / "figures.jsonl", tmp_path / "gpu_check.json"
    figures.write_text("\n".join(rows) + "\n")
    proc = subprocess.run([sys.executable, "tools/gpu_check_report.py", str(figures), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    return proc, out


def test_report_table_and_mfu_json(tmp_path: Path) -> None:
    rows = [json.dumps({"check": "c_20b_block_fwd_bwd", **BLOCK}),
            json.dumps({"check": "a_local_vs_diffusers_bf16", "max_abs_diff": 1e-3, "ours_vs_fp32": 4e-3,
                        "diffusers_vs_fp32": 4e-3, "output_abs_max": 2.0})]
    proc, out = _report(tmp_path, rows)
    assert proc.returncode == 0, proc.stderr
    assert "MFU 0.506 of 790 (0.404 of 989)" in proc.stdout and "max |ours - diffusers| 1.000e-03" in proc.stdout
    assert proc.stdout.count("not run") == 4  # (b), (d), (e) and (f)
    assert measured_mfu(str(out)) == 0.404
    assert not list(tmp_path.glob(".*partial"))


def test_report_without_block_has_no_mfu_and_bad_lines_fail(tmp_path: Path) -> None:
    proc, out = _report(tmp_path, [])
    assert proc.returncode == 0 and "no MFU" in proc.stdout
    assert "mfu" not in json.loads(out.read_text())
    proc, _ = _report(tmp_path, ["{broken"])
    assert proc.returncode == 1 and "figures.jsonl:1: not JSON" in proc.stderr


def test_report_prints_the_fp8_rollout_checks(tmp_path: Path) -> None:
    fp8 = {f"batch_{b}": dict(bf16_block_ms=2.0 * b, fp8_block_ms=1.25 * b, speedup=1.6, output_rel_err=0.031)
           for b in (1, 4, 8)}
    engine = dict(bf16_images_per_s=10.0, fp8_images_per_s=12.5, speedup=1.25, probe_diff=2e-3, probe_bound=9e-2)
    proc, out = _report(tmp_path, [json.dumps({"check": "e_fp8_forward_20b_block", **fp8}),
                                   json.dumps({"check": "f_vllm_omni_fp8_rollout", **engine})])
    assert proc.returncode == 0, proc.stderr
    assert "batch 8: bf16   16.00 ms  FP8   10.00 ms per block  speed-up 1.60" in proc.stdout
    assert "FP8 12.50 images/s (speed-up 1.25); FP8 probe 2.000e-03 <= bound 9.000e-02" in proc.stdout
    assert proc.stdout.count("not run (") == 4  # (a) to (d)
    assert json.loads(out.read_text())["figures"]["e_fp8_forward_20b_block"]["batch_8"]["speedup"] == 1.6


def test_block_throughput_check_holds_the_planner_assumption() -> None:
    """tests/gpu/test_dit_cuda.py's bound, on CPU: figures near the planner's MFU pass; batch 1 under half of it,
    or any batch above what cuBLAS reaches, fails naming the batch."""
    import pytest

    from tests.gpu.cuda import check_block_throughput

    rows = {int(k.split("_")[1]): dict(v) for k, v in BLOCK.items()}
    check_block_throughput(rows)
    check_block_throughput({**rows, 1: {**rows[1], "mfu": 0.175, "tflops": 173.1}})  # exactly the floor
    with pytest.raises(AssertionError, match="batch 1: MFU 0.174 < 0.175"):
        check_block_throughput({**rows, 1: {**rows[1], "mfu": 0.174, "tflops": 172.1}})
    with pytest.raises(AssertionError, match=r"batch 4: 800.0 TFLOP/s is outside \(0, 790\]"):
        check_block_throughput({**rows, 4: {**rows[4], "tflops": 800.0}})
    with pytest.raises(AssertionError, match="batch 2"):
        check_block_throughput({**rows, 2: {**rows[2], "tflops": 0.0}})
