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
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve and validate the config, then print the predicted per-GPU memory and step time")
    ap.add_argument("--gpu", default="H200", help="GPU kind for --dry-run (H200, H800)")
    return ap.parse_args(argv)


def dry_run(cfg, world_size: int, gpu: str) -> None:
    """Print the planner's report for this job; needs no GPU and loads no weights."""
    import json
    from pathlib import Path

    from megatron_omni.parallel.layout import ParallelLayout
    from megatron_omni.trainer.planner import RolloutSpec, Workload, plan

    if cfg.model.pipeline == "tiny":
        from model_providers.qwen_image.tiny_pipeline import TinyPipelineConfig

        tiny = TinyPipelineConfig()
        model = dict(vars(tiny.transformer), joint_attention_dim=tiny.text_hidden_size)
        rollout = RolloutSpec(extra_params=0)  # the tiny text encoder and VAE are negligible
    else:
        model = json.loads((Path(cfg.model.pipeline) / "transformer" / "config.json").read_text())
        rollout = RolloutSpec()
    r, p = cfg.rollout, cfg.parallel
    workload = Workload(height=r.height, width=r.width, sampling_steps=r.num_steps, window=r.window_size,
                        prompts=r.prompts_per_step, group_size=r.group_size, mini_batches=cfg.optim.mini_batches,
                        cfg=r.guidance_scale > 1, recompute_old_logprob=cfg.algorithm.old_logprob == "recompute")
    report = plan(model, ParallelLayout(tp=p.tp, ulysses=p.ulysses, ring=p.ring, pp=p.pp), world_size, gpu,
                  workload, rollout=rollout, recompute=cfg.model.recompute or "none")
    print(report.table())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = apply_overrides(load_recipe(args.recipe), args.overrides)
        if args.resume is not None:
            cfg.checkpoint.resume = args.resume
        cfg.validate(world_size)
        if args.dry_run:
            from megatron_omni.parallel.layout import LayoutError

            try:
                dry_run(cfg, world_size, args.gpu)
            except LayoutError as exc:
                raise ConfigError(f"layout: {exc}") from exc
            return 0
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
