"""Rollout throughput: DiffusersRolloutEngine with step-wise batching vs a one-request-at-a-time loop.

Both sides run in this process on the same prompts, seeds and pipeline (the `small` transformer preset,
a few million parameters, built offline into a temp folder): the reference loop sends one request
(one sample) at a time through the engine with max_batch_size=1, ours submits all samples and lets
step-wise continuous batching fill each forward. Several alternating runs; medians; the ratio is printed
LAST. Target: >= 1.5.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout.py [--runs 3] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omni.rollout.base import SamplingParams  # noqa: E402
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine  # noqa: E402
from model_providers.qwen_image.tiny_pipeline import SMALL_TRANSFORMER, TinyPipelineConfig, make_tiny_pipeline  # noqa: E402

PROMPTS = ["OPEN 24 HOURS", "a red cat on a mat", "STOP", "hello world"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="max samples per forward (ours)")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--size", type=int, default=64, help="image height = width")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    params = SamplingParams(
        height=args.size,
        width=args.size,
        num_steps=args.steps,
        noise_level=1.2,
        window_size=2,
        window_range=(0, args.steps // 2),
    )
    n = len(PROMPTS) * args.group
    seeds = list(range(n))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_pipeline(Path(tmp) / "small", seed=0, config=TinyPipelineConfig(SMALL_TRANSFORMER))
        ours = DiffusersRolloutEngine(folder, max_batch_size=args.batch)
        ref = DiffusersRolloutEngine(folder, max_batch_size=1)
        params_m = sum(p.numel() for p in ours.transformer.parameters()) / 1e6
        print(
            f"small transformer: {params_m:.2f}M parameters; {n} samples of {args.size}px, "
            f"{args.steps} steps, torch threads {torch.get_num_threads()}"
        )

        def run_ours() -> float:
            t0 = time.perf_counter()
            ours.generate(PROMPTS, params, group_size=args.group, seeds=seeds)
            return n / (time.perf_counter() - t0)

        def run_ref() -> float:
            t0 = time.perf_counter()
            for i in range(n):
                ref.generate([PROMPTS[i // args.group]], params, group_size=1, seeds=[seeds[i]])
            return n / (time.perf_counter() - t0)

        run_ours(), run_ref()  # warm-up (first-call allocations, prompt cache)
        ours_ips, ref_ips = [], []
        for _ in tqdm(range(args.runs), desc="runs"):
            ref_ips.append(run_ref())
            ours_ips.append(run_ours())
    med_ours, med_ref = statistics.median(ours_ips), statistics.median(ref_ips)
    # Each run pairs the two sides back to back, so the paired ratio is robust to load on a shared machine.
    ratio = statistics.median(o / r for o, r in zip(ours_ips, ref_ips))
    print(
        f"one-request-at-a-time loop: {med_ref:.2f} images/s  (runs: {', '.join(f'{x:.2f}' for x in ref_ips)})"
    )
    print(
        f"step-wise batching (max {args.batch}): {med_ours:.2f} images/s  "
        f"(runs: {', '.join(f'{x:.2f}' for x in ours_ips)})"
    )
    print(f"ratio (batched / one-at-a-time, median of paired runs): {ratio:.2f}")


if __name__ == "__main__":
    main()
