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
import atexit
import os
import sys
import threading
from typing import NoReturn

from megatron_omni.parallel.job_report import global_rank, report_on_rank0
from megatron_omni.trainer.config import ConfigError, apply_overrides, load_recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_omni.train", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="examples.tiny.recipe:jpeg_demo", help="MODULE:FUNCTION returning a JobConfig")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                    help="override a config field (repeatable)")
    ap.add_argument("--resume", default=None,
                    help="'auto' (the newest intact checkpoint of run_dir; refused when there is none), "
                         "'auto-or-new' (the same, or a new run when run_dir has no checkpoint) or a checkpoint folder")
    ap.add_argument("--overwrite", action="store_true",
                    help="clear run_dir's run files (config, metrics, checkpoints, samples, ...) and start anew; "
                         "without it a run_dir holding a run is refused")
    ap.add_argument("--dry-run", action="store_true",
                    help="resolve and validate the config, then print the predicted per-GPU memory and step time")
    ap.add_argument("--check", action="store_true",
                    help="validate the config, run folder and input files for WORLD_SIZE, then exit (0 valid, 2 not); "
                         "the launch scripts run it before torchrun, which reports a failed worker as rc 1")
    ap.add_argument("--gpu", default="H200", help="GPU kind for --dry-run (H200, H800)")
    ap.add_argument("--gpus-per-node", type=int, default=8,
                    help="--dry-run: GPUs per node (collectives inside a node use NVLink, across nodes the network)")
    ap.add_argument("--reward-gpus", type=int, default=0,
                    help="--dry-run: GPUs the job holds for the reward server (counted in images/s/GPU)")
    ap.add_argument("--mfu-from", default=None, metavar="FILE",
                    help="--dry-run: the JSON tools/gpu_check.sh writes; its measured MFU replaces the assumed 0.35")
    return ap.parse_args(argv)


def _is_rank0() -> bool:
    """Whether this process prints job-wide messages: torchrun's global rank 0 (RANK), or a lone process."""
    return global_rank() == 0


def _config_error(exc: Exception) -> int:
    """One line on rank 0 only: every rank validates the same config and exits 2, before the process group
    exists; under torchrun the other ranks leave only once rank 0 has printed (`report_on_rank0`: torchrun kills
    the job's other workers when the first exits)."""
    report_on_rank0(f"config error: {exc}")
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = apply_overrides(load_recipe(args.recipe), args.overrides)
        if args.resume is not None:
            cfg.checkpoint.resume = args.resume
        cfg.validate(world_size, planning=args.dry_run)
        if args.check and args.dry_run:
            raise ConfigError("--check and --dry-run are two different stops: give one")
        if args.mfu_from is not None and not args.dry_run:
            raise ConfigError("--mfu-from is read by --dry-run only")
        if args.dry_run:
            from megatron_omni.trainer.dry_run import dry_run

            return dry_run(cfg, world_size, args.gpu, args.gpus_per_node, args.reward_gpus, args.mfu_from)
        from megatron_omni.trainer.config_checks import check_files
        from megatron_omni.trainer.rewards import RewardPreflightError, preflight
        from megatron_omni.trainer.run_folder import check_run_dir

        if not args.check:  # a launch script checks before it starts the reward server
            try:
                preflight(cfg.reward.url, scorer=cfg.reward.scorer)
            except RewardPreflightError as exc:
                raise ConfigError(str(exc)) from None
        check_run_dir(cfg, args.overwrite)  # reads only
        check_files(cfg)  # last: it creates the run folder
        if args.check:
            if _is_rank0():
                print(f"config OK for world size {world_size}: {cfg.run_dir}")
            return 0
    except ConfigError as exc:
        return _config_error(exc)

    from megatron_omni.parallel import failure_notice, platform
    from megatron_omni.reward.errors import RewardServiceError, RewardWeightsError
    from megatron_omni.rollout.async_service import RolloutRankFailed, RolloutRankLost, StalenessError
    from megatron_omni.rollout.vllm_omni.faults import EngineStartError, EngineWorkerDied
    from megatron_omni.trainer.flowgrpo import LogpGapError
    from megatron_omni.trainer.preemption import STOPPED_EXIT, TrainingStopped
    from megatron_omni.trainer.run import run

    platform.init_distributed()
    # colocated: a rank that fails with a named cause tells the others (disaggregated: the rollout service relays
    # a rollout rank's failure to the trainer, whose stop reaches the rollout ranks)
    notice = cfg.placement.mode == "colocated" and failure_notice.watch()
    try:
        summary = run(cfg, overwrite=args.overwrite)
    except TrainingStopped as exc:  # every rank stops after the same step (the stop flag is all-reduced)
        print(str(exc), file=sys.stderr)
        return STOPPED_EXIT
    except ConfigError as exc:  # found once the run is set up: no intact checkpoint, a checkpoint not written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except LogpGapError as exc:  # every rank raises it at the same step (the gap is reduced over data parallel)
        print(f"train/rollout mismatch: {exc}", file=sys.stderr)
        return 4
    except RewardWeightsError as exc:  # the scorer's weights are missing or foreign: found building it, before training
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except RewardServiceError as exc:  # the server stopped answering: named, never a traceback or a reward of 0
        print(f"reward server error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (RolloutRankLost, RolloutRankFailed, StalenessError) as exc:  # names the rank or the step (docs/async.md)
        print(f"rollout error: {exc}", file=sys.stderr, flush=True)
        # The rollout client's receiver threads may still be inside a receive from the rank that left: tearing the
        # process groups down under them can abort the process (SIGABRT, seen once in the suite), turning this named
        # exit 1 into -6. Everything of the run is closed by now (run() has unwound), so leave without the teardown.
        sys.stdout.flush()
        os._exit(1)
    except (EngineStartError, EngineWorkerDied) as exc:  # one line naming the cause, or the worker and the step
        print(f"rollout engine error: {exc}", file=sys.stderr, flush=True)
        if notice:  # the other ranks print the same cause and leave now, not when their collective fails
            failure_notice.publish(f"rollout engine error: {exc}", 1)
        return 1
    finally:
        platform.destroy_distributed()
    if "last_reward" in summary:
        print(f"\nreward mean: first step {summary['first_reward']:.4g} -> last step {summary['last_reward']:.4g} "
              f"over {summary['steps']} steps")
        if "eval_after" in summary:
            b, a = summary["eval_before"], summary["eval_after"]
            transfer = (f", transfer {b['transfer_reward_mean']:.4g} -> {a['transfer_reward_mean']:.4g}"
                        if "transfer_reward_mean" in a else "")
            print(f"held-out eval (ODE): reward {b['reward_mean']:.4g} -> {a['reward_mean']:.4g} "
                  f"(seen {b['seen_reward_mean']:.4g} -> {a['seen_reward_mean']:.4g}, unseen "
                  f"{b['unseen_reward_mean']:.4g} -> {a['unseen_reward_mean']:.4g}{transfer}); peak "
                  f"{a['peak_reward_mean']:.4g} at step {a['peak_step']}; eval_before_after.png")
        print(f"run folder: {summary['run_dir']} (metrics.jsonl, reward_curve.png, samples/, tensorboard/, "
              f"checkpoints/, config.json)")
    return 0


def exit_without_teardown(status: int) -> NoReturn:
    """Leave with `status` after what a normal exit does for the run (join the threads that are not daemons, run
    the atexit handlers: multiprocessing joins its children, vLLM-Omni closes its engine; flush stdout and stderr),
    but without the interpreter's teardown. After a run that teardown is a full garbage collection over the ~5000
    modules torch, megatron-core, diffusers and transformers loaded: 2-3 s of CPU per rank (longer on a busy
    machine) that frees memory the OS frees anyway. Every file of the run is closed by then (`run` closes its
    writers, the checkpoint is renamed into place)."""
    # What Py_FinalizeEx does first, in its order: the threading module's exit hooks (idle
    # concurrent.futures workers are told to stop, so a plain join of every non-daemon thread could wait on one
    # forever), then the joins, then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to tell
            pass
    os._exit(0 if status is None else status)


if __name__ == "__main__":
    exit_without_teardown(main())
