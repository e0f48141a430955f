"""Train the tiny AR-DiT recipe: `torchrun --nproc-per-node N -m examples.ar_dit.train --out DIR [--tp 2]`
(or plain `python -m examples.ar_dit.train` for one rank). Metrics go to DIR/metrics.jsonl; `--save-every N`
checkpoints into DIR/checkpoints, `--resume` continues from the newest complete one."""

from __future__ import annotations

import argparse

from examples.ar_dit.recipe import run, tiny_config
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="run folder (metrics.jsonl is appended)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1, help="context parallel (Ulysses) size of both halves")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = parser.parse_args()
    platform.init_distributed()
    groups = build_parallel_groups(ParallelLayout(tp=args.tp, ulysses=args.cp))
    for m in run(tiny_config(args.seed), groups, args.steps, out_dir=args.out, save_every=args.save_every,
                 resume=args.resume):
        if groups.rank == 0:
            print(f"step {m['step']}: reward {m['reward_mean']:.3f} (image {m['reward_image']:.3f}, "
                  f"tokens {m['reward_tokens']:.3f}) {m['time_step']:.2f} s")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
