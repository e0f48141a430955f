"""The GPU check's table and JSON from the figures its tests recorded (tools/gpu_check.sh runs it).

    python tools/gpu_check_report.py FIGURES.jsonl OUT.json

Prints one table, (a) to (f), naming each check that did not run; writes OUT.json (atomically) with every
figure and `mfu`: the 20B block's forward+backward MFU at batch 1 against the 989 TFLOP/s bf16 peak the
planner uses (batch 1 is the recipes' training micro-batch), which `--dry-run --mfu-from OUT.json` reads.
Exits 1 when a figures line is not JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CHECKS = {
    "a_local_vs_diffusers_bf16": "(a) local model vs diffusers, CUDA bf16",
    "b_small_flowgrpo_step_bf16": "(b) one FlowGRPO step, small preset, bf16, 1 GPU",
    "c_20b_block_fwd_bwd": "(c) 20B-shaped block fwd+bwd, 1024 img + 256 txt tokens",
    "d_te_vs_local_bf16": "(d) te spec vs local, bf16",
    "e_fp8_forward_20b_block": "(e) FP8 rollout forward vs bf16, 20B-shaped blocks (quantized linears in FP8)",
    "f_vllm_omni_fp8_rollout": "(f) vLLM-Omni engine, FP8 vs bf16 rollout, small tiny pipeline",
}


def read_figures(path: Path) -> dict[str, dict]:
    """{check: figures} from the JSON-lines file the tests appended to (a missing file: nothing ran)."""
    figures: dict[str, dict] = {}
    if not path.exists():
        return figures
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        figures[row.pop("check")] = row
    return figures


def table(figures: dict[str, dict]) -> str:
    """The printable table, one block per check."""
    lines = []
    for key, title in CHECKS.items():
        f = figures.get(key)
        lines.append(title)
        if f is None:
            lines.append("    not run (skipped or failed: see pytest.log)")
        elif key == "a_local_vs_diffusers_bf16":
            lines.append(f"    max |ours - diffusers| {f['max_abs_diff']:.3e}   vs fp32: ours {f['ours_vs_fp32']:.3e}, "
                         f"diffusers {f['diffusers_vs_fp32']:.3e} (outputs up to {f['output_abs_max']:.2f})")
        elif key == "b_small_flowgrpo_step_bf16":
            phases = {k: v for k, v in f.items() if k not in ("images_per_s", "train_rollout_dlogp")}
            lines.append("    " + "  ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
            lines.append(f"    {f['images_per_s']:.2f} images/s, train/rollout |dlogp| {f['train_rollout_dlogp']:.2e}")
        elif key == "c_20b_block_fwd_bwd":
            for batch, r in f.items():
                lines.append(f"    {batch.replace('_', ' ')}: {r['block_ms']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s  "
                             f"MFU {r['mfu_790']:.3f} of 790 ({r['mfu']:.3f} of 989)")
        elif key == "d_te_vs_local_bf16":
            lines.append(f"    out max abs diff {f['out_max_abs_diff']:.3e} (outputs up to {f['out_abs_max']:.2f}), "
                         f"grad max rel diff {f['grad_max_rel_diff']:.3e}")
        elif key == "e_fp8_forward_20b_block":
            for batch, r in f.items():
                lines.append(f"    {batch.replace('_', ' ')}: bf16 {r['bf16_block_ms']:7.2f} ms  "
                             f"FP8 {r['fp8_block_ms']:7.2f} ms per block  speed-up {r['speedup']:.2f}  "
                             f"(FP8 output rel. error {r['output_rel_err']:.3f})")
        else:
            lines.append(f"    bf16 {f['bf16_images_per_s']:.2f} images/s, FP8 {f['fp8_images_per_s']:.2f} "
                         f"images/s (speed-up {f['speedup']:.2f}); FP8 probe {f['probe_diff']:.3e} <= bound "
                         f"{f['probe_bound']:.3e}")
    return "\n".join(lines)


def summary(figures: dict[str, dict]) -> dict:
    """The JSON the dry run reads: every figure, plus `mfu` when the block throughput was measured."""
    out: dict = {"figures": figures}
    block = figures.get("c_20b_block_fwd_bwd", {}).get("batch_1")
    if block is not None:
        out["mfu"] = block["mfu"]
        out["mfu_source"] = "20B block fwd+bwd, batch 1, of the 989 TFLOP/s bf16 peak"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        figures = read_figures(Path(argv[0]))
    except ValueError as exc:
        print(f"gpu check report: {exc}", file=sys.stderr)
        return 1
    print(table(figures))
    out = Path(argv[1])
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_text(json.dumps(summary(figures), indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}" + ("" if "mfu" in summary(figures) else " (no MFU: the block throughput did not run)"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
