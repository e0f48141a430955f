"""Time of one AR-DiT RL step (the tiny hybrid's joint GRPO + FlowGRPO step: plan rollout, DiT rollout,
recomputed old log-probs, update, weight sync) at TP=1, TP=2 and CP=2 on CPU gloo ranks, and the share of the step
spent in the decoder (plan sampling, conditioning, token log-probs, decoder backward) versus the DiT
(denoising, window log-probs, DiT backward; the optimizer step is counted with the DiT).

Each side runs one warm-up step, then `--steps` measured steps; medians are printed per layout, then the
TP=2 / TP=1 and CP=2 / TP=1 step-time ratios, and LAST the decoder-vs-DiT share (TP=1).
Usage: python benchmarks/ar_dit_step.py [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omni.parallel import rank_pool  # noqa: E402


def _steps(rank: int, world_size: int, layout: dict[str, int], steps: int) -> list[dict]:
    from tqdm import tqdm

    from examples.ar_dit.recipe import BrightnessAndLowTokens, tiny_config
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.ar_dit import ARDiTTrainer

    groups = build_parallel_groups(ParallelLayout(**layout))
    trainer = ARDiTTrainer(tiny_config(), groups, BrightnessAndLowTokens(vocab_size=128))
    out = []
    for step in tqdm(range(steps + 1), desc=f"{layout} rank {rank}", disable=rank != 0):
        metrics = trainer.train_step(step).metrics
        if step > 0:  # step 0 warms up (first-use allocations, lazy imports)
            out.append(metrics)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    med = {}
    layouts = {"tp=1": dict(tp=1), "tp=2": dict(tp=2), "cp=2": dict(ulysses=2)}
    for name, layout in layouts.items():
        ranks = layout.get("tp", 1) * layout.get("ulysses", 1)
        metrics = rank_pool.run_ranks(_steps, ranks, layout, args.steps, timeout_s=900)[0]
        rank_pool.close_pools()  # one layout's ranks at a time on the shared cores
        med[name] = {k: statistics.median(m[k] for m in metrics) for k in ("time_step", "time_decoder", "time_dit")}
        print(f"{name}: step {med[name]['time_step']:.3f} s (median of {args.steps}), decoder "
              f"{med[name]['time_decoder']:.3f} s, DiT {med[name]['time_dit']:.3f} s")
    for name in ("tp=2", "cp=2"):
        print(f"step time {name} / tp=1: {med[name]['time_step'] / med['tp=1']['time_step']:.2f}")
    d, t = med["tp=1"]["time_decoder"], med["tp=1"]["time_dit"]
    print(f"decoder vs DiT share of the step (tp=1): decoder {100 * d / (d + t):.0f}% / DiT {100 * t / (d + t):.0f}%")


if __name__ == "__main__":
    main()
