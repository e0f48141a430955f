"""Entry point: `python -m megatron_omni.train --recipe MODULE:FUNCTION [--set a.b=value ...] [--resume auto]`.

Runs under torchrun (every rank runs this) or as one process. The config is resolved and validated against
the world size before any work starts; a bad field exits non-zero with a message naming it.

`--dry-run` (with WORLD_SIZE = trainer ranks in the environment; the launch scripts' DRY_RUN=1 sets it) stops
there: it validates the layout against the model, prints the planner's per-GPU memory, predicted step time and
the weight-sync plan, and exits 0 when the job fits, 2 for an invalid config or layout, 3 when it does not fit
in GPU memory. Nothing is loaded and no GPU is needed. A run whose train/rollout log-prob gap exceeds
`algorithm.max_logp_gap` stops with exit status 4 and a message naming the step.
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
    ap.add_argument("--gpus-per-node", type=int, default=8,
                    help="--dry-run: GPUs per node (collectives inside a node use NVLink, across nodes the network)")
    ap.add_argument("--reward-gpus", type=int, default=0,
                    help="--dry-run: GPUs the job holds for the reward server (counted in images/s/GPU)")
    ap.add_argument("--mfu-from", default=None, metavar="FILE",
                    help="--dry-run: the JSON tools/gpu_check.sh writes; its measured MFU replaces the assumed 0.35")
    return ap.parse_args(argv)


def _model_config(cfg) -> tuple[dict, str]:
    """The transformer's diffusers config for planning and where it came from: the pipeline folder's
    transformer/config.json when it is at hand, else `model.preset` (so a job can be planned on a laptop)."""
    import json
    from pathlib import Path

    from model_providers.qwen_image.provider import hf_config

    if cfg.model.pipeline == "tiny":
        from model_providers.qwen_image.tiny_pipeline import TinyPipelineConfig

        tiny = TinyPipelineConfig()
        return dict(vars(tiny.transformer), joint_attention_dim=tiny.text_hidden_size), "tiny pipeline"
    path = Path(cfg.model.pipeline) / "transformer" / "config.json"
    if path.exists():
        model = json.loads(path.read_text())
        if cfg.model.preset is not None and hf_config(model) != hf_config(cfg.model.preset):
            raise ConfigError(f"model.preset={cfg.model.preset!r} does not match {path}: "
                              f"{hf_config(cfg.model.preset)} != {hf_config(model)}")
        return model, str(path)
    if cfg.model.preset is None:
        raise ConfigError(f"model.pipeline={cfg.model.pipeline!r}: no {path} to plan with; point it at a diffusers "
                          "Qwen-Image folder or set model.preset (e.g. --set model.preset=20b)")
    try:
        hf_config(cfg.model.preset)
    except KeyError as exc:
        raise ConfigError(f"model.preset: {exc.args[0]}") from None
    return cfg.model.preset, f"preset {cfg.model.preset!r} ({path} not found here)"


def dry_run(cfg, world_size: int, gpu: str, gpus_per_node: int = 8, reward_gpus: int = 0,
            mfu_from: str | None = None) -> bool:
    """Print the planner's report and the bridge plan for this job; needs no GPU and loads no weights.
    `mfu_from`: a JSON written by tools/gpu_check.sh whose measured MFU replaces the assumed one.
    Returns whether the plan fits in GPU memory."""
    from megatron_omni.bridge.qwen_image import qwen_image_plan, sync_mode
    from megatron_omni.parallel.layout import ParallelLayout
    from megatron_omni.trainer.planner import DEFAULT_MFU, Precision, RolloutSpec, Workload, measured_mfu, plan

    mfu, mfu_source = DEFAULT_MFU, None
    if mfu_from is not None:
        try:
            mfu = measured_mfu(mfu_from)
        except ValueError as exc:
            raise ConfigError(f"--mfu-from: {exc}") from None
        mfu_source = mfu_from

    model, source = _model_config(cfg)
    r, p = cfg.rollout, cfg.parallel
    # What the trainer does (trainer/flowgrpo.py): the engine is colocated with the trainer and every rollout
    # group of rollout.tp ranks rolls out its share of the images. The embedded diffusers engine (tp=1) keeps
    # its full weights resident; vLLM-Omni sleeps during the update. The tiny pipeline's text encoder and VAE
    # are negligible.
    dp = world_size // (p.tp * p.ulysses * p.ring * p.pp)
    vllm = r.engine == "vllm_omni"
    rollout = RolloutSpec(tp=r.tp, sleeps=vllm, in_process=not vllm,
                          extra_params=0 if cfg.model.pipeline == "tiny" else RolloutSpec.extra_params)
    precision = Precision.of(cfg.model.params_dtype, r.dtype, cfg.optim.distributed_optimizer)
    per_replica = r.prompts_per_step * r.group_size // cfg.optim.mini_batches // dp
    workload = Workload(height=r.height, width=r.width, sampling_steps=r.num_steps, window=r.window_size,
                        prompts=r.prompts_per_step, group_size=r.group_size, mini_batches=cfg.optim.mini_batches,
                        micro_batch_size=cfg.optim.micro_batch_size or max(per_replica, 1),
                        cfg=r.guidance_scale > 1, recompute_old_logprob=cfg.algorithm.old_logprob == "recompute")
    report = plan(model, ParallelLayout(tp=p.tp, ulysses=p.ulysses, ring=p.ring, pp=p.pp), world_size, gpu,
                  workload, rollout=rollout, precision=precision, recompute=cfg.model.recompute or "none",
                  gpus_per_node=gpus_per_node, reward_gpus=reward_gpus, mfu=mfu)
    # On the cluster vLLM-Omni's workers are processes of their own: its sync is full mode (bucketed RPCs).
    mode = "full" if vllm else sync_mode(p.tp, p.pp, r.tp)
    sync = qwen_image_plan(model, trainer_tp=p.tp, trainer_pp=p.pp, rollout_kind=r.engine, rollout_tp=r.tp, mode=mode)
    elements = sync.numel_per_rollout_rank()[0]
    print(f"dry run: world size {world_size} trainer ranks + {reward_gpus} reward GPUs, model from {source}")
    print(f"precision: model {cfg.model.params_dtype} ({cfg.model.backend} layer spec), rollout {r.engine} engine "
          f"in {r.dtype} at tp={r.tp}" + (f"; MFU {mfu:.3f} from {mfu_source}" if mfu_source else ""))
    print(report.table())
    print(f"bridge: {len(sync.sources)} Megatron tensors -> {len(sync.params)} rollout parameters ({mode} mode, "
          f"{r.engine} engine tp={r.tp}), {elements:,} elements = "
          f"{elements * precision.rollout_param_bytes / 2**30:.2f} GiB {r.dtype} per rollout rank per sync")
    m = report.memory
    total = m.total
    # The frozen reference of the KL term (in the parameters' dtype) and the EMA of the weights (fp32): each one
    # more copy of this rank's shard (not in the planner's total).
    copies = [(f"KL reference (algorithm.beta={cfg.algorithm.beta:g})", cfg.algorithm.beta > 0,
               report.precision.param_bytes),
              (f"EMA of the weights (optim.ema_decay={cfg.optim.ema_decay:g}, fp32)", cfg.optim.ema_decay > 0, 4)]
    for label, kept, bytes_per_param in copies:
        if kept:
            copy = bytes_per_param * max(report.stage_parameters)
            total += copy
            print(f"{label}: + {copy / 2**30:.1f} GiB per GPU -> {total / 2**30:.1f} GiB of "
                  f"{m.capacity / 2**30:.1f} GiB")
    return m.fits and total <= m.capacity


def _is_rank0() -> bool:
    """Whether this process prints job-wide messages: torchrun's global rank 0 (RANK), or a lone process."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def _config_error(exc: Exception) -> int:
    """One line on rank 0 only (every rank validates the same config and exits 2 at once, before the process
    group exists, so no rank waits on another)."""
    if _is_rank0():
        print(f"config error: {exc}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = apply_overrides(load_recipe(args.recipe), args.overrides)
        if args.resume is not None:
            cfg.checkpoint.resume = args.resume
        cfg.validate(world_size)
        if args.mfu_from is not None and not args.dry_run:
            raise ConfigError("--mfu-from is read by --dry-run only")
        if args.dry_run:
            from megatron_omni.parallel.layout import LayoutError

            try:
                fits = dry_run(cfg, world_size, args.gpu, args.gpus_per_node, args.reward_gpus, args.mfu_from)
            except LayoutError as exc:
                raise ConfigError(f"layout: {exc}") from exc
            if not fits:
                print(f"plan error: the layout does not fit in {args.gpu} memory (see 'total' above): raise "
                      "parallel.tp / parallel.ulysses, set model.recompute=full, or use more GPUs", file=sys.stderr)
                return 3
            print("dry run OK: the layout is valid for this world size and fits")
            return 0
        from megatron_omni.trainer.config_checks import check_files
        from megatron_omni.trainer.rewards import RewardPreflightError, preflight

        try:
            preflight(cfg.reward.url)
        except RewardPreflightError as exc:
            raise ConfigError(str(exc)) from None
        check_files(cfg)  # last: it creates the run folder
    except ConfigError as exc:
        return _config_error(exc)

    from megatron_omni.parallel import platform
    from megatron_omni.reward.errors import RewardServiceError
    from megatron_omni.trainer.flowgrpo import LogpGapError
    from megatron_omni.trainer.run import run

    platform.init_distributed()
    try:
        summary = run(cfg)
    except LogpGapError as exc:  # every rank raises it at the same step (the gap is reduced over data parallel)
        print(f"train/rollout mismatch: {exc}", file=sys.stderr)
        return 4
    except RewardServiceError as exc:  # the server stopped answering: named, never a traceback or a reward of 0
        print(f"reward server error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        platform.destroy_distributed()
    if "last_reward" in summary:
        print(f"\nreward mean: first step {summary['first_reward']:.4g} -> last step {summary['last_reward']:.4g} "
              f"over {summary['steps']} steps")
        if "eval_after" in summary:
            b, a = summary["eval_before"], summary["eval_after"]
            print(f"held-out eval (ODE): reward {b['reward_mean']:.4g} -> {a['reward_mean']:.4g} "
                  f"(seen {b['seen_reward_mean']:.4g} -> {a['seen_reward_mean']:.4g}, unseen "
                  f"{b['unseen_reward_mean']:.4g} -> {a['unseen_reward_mean']:.4g}); eval_before_after.png")
        print(f"run folder: {summary['run_dir']} (metrics.jsonl, reward_curve.png, samples/, tensorboard/, "
              f"checkpoints/, config.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
