"""Entry point: `python -m megatron_omni.train --recipe MODULE:FUNCTION [--set a.b=value ...] [--resume auto]`.

Runs under torchrun (every rank runs this) or as one process. The config is resolved and validated against
the world size before any work starts; a bad field exits non-zero with a message naming it.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_omni.trainer.config import ConfigError, apply_overrides, load_recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_omni.train", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="examples.tiny.recipe:jpeg_demo", help="MODULE:FUNCTION returning a JobConfig")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                    help="override a config field (repeatable)")
    ap.add_argument("--resume", default=None, help="'auto' (latest complete checkpoint) or a checkpoint folder")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = apply_overrides(load_recipe(args.recipe), args.overrides)
        if args.resume is not None:
            cfg.checkpoint.resume = args.resume
        cfg.validate(world_size)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2

    from megatron_omni.parallel import platform
    from megatron_omni.trainer.run import run

    platform.init_distributed()
    try:
        summary = run(cfg)
    finally:
        platform.destroy_distributed()
    if "last_reward" in summary:
        print(f"\nreward mean: first step {summary['first_reward']:.4g} -> last step {summary['last_reward']:.4g} "
              f"over {summary['steps']} steps")
        print(f"run folder: {summary['run_dir']} (metrics.jsonl, reward_curve.png, samples/, tensorboard/, "
              f"checkpoints/, config.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
