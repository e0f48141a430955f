"""The training run of every model family: set-up, the step loop with a progress bar, checkpoints, metrics and
pictures. The trainer is picked by the family's kind (`model_providers.get_family(model.family).kind`):
"dit" -> `FlowGRPOTrainer`, "ar_dit" -> `ARDiTTrainer`, or the trainer module a family names
(`ModelFamily.trainer`: BAGEL's `BagelTrainer`); all return a `skeleton.StepResult` per step and carry
what a checkpoint needs (`model`, `optimizer`, `scheduler`, `ema`, `extra_copies` (other frozen copies by name),
`sharded_state`, `content_metadata`, `guard`, `checkpoint_identity`: what a resume must match), so this loop, its
checkpoints and its resume are the same for both."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.placement import build_placement_groups, split_world
from megatron_omni.rollout.async_service import RolloutRankFailed, RolloutRankLost, StalenessError
from megatron_omni.trainer import atomic_files
from megatron_omni.trainer.checkpoint_folders import resume_folder, run_id_of
from megatron_omni.trainer.checkpointing import ASYNC_IN_FLIGHT, load_checkpoint, read_common, save_checkpoint
from megatron_omni.trainer.config import ConfigError, JobConfig, to_dict
from megatron_omni.trainer.evaluation import EvalResult, eval_samples, evaluate, save_before_after_grid, with_peak
from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer, LogpGapError
from megatron_omni.trainer.metrics import (
    MetricsWriter,
    read_history,
    reward_captions,
    save_reward_curve,
    save_samples,
)
from megatron_omni.trainer.preemption import StopRequests, TrainingStopped
from megatron_omni.trainer.rewards import RewardFunction
from megatron_omni.trainer.run_folder import clear_run_dir, new_run_id
from model_providers import get_family

SHOWN = ("reward_mean", "clipfrac", "approx_kl", "grad_norm", "images_per_s_per_rank")


def prepare_pipeline(cfg: JobConfig, run_dir: Path) -> Path:
    """The diffusers pipeline folder to train; "tiny" builds the model family's offline tiny pipeline (rank 0,
    once)."""
    if cfg.model.pipeline != "tiny":
        path = Path(cfg.model.pipeline)
        if not (path / "model_index.json").exists():
            raise FileNotFoundError(f"model.pipeline={cfg.model.pipeline!r} is not a diffusers pipeline folder")
        return path
    tiny = get_family(cfg.model.family).tiny_pipeline
    if tiny is None:
        raise ConfigError(f"model.pipeline=tiny: model family {cfg.model.family!r} has no offline tiny pipeline")
    path = run_dir / "pipeline"
    if dist.get_rank() == 0 and not path.exists():
        tiny.make(path, cfg.model.tiny_seed)
    dist.barrier()
    return path


def run_evaluation(cfg: JobConfig, trainer: FlowGRPOTrainer, run_dir: Path, done: int, job=None) -> None:
    """Held-out evaluation after `done` RL steps (`record_evaluation` on rank 0), with the EMA of the weights
    when `optim.ema_decay` is set. Collective over the trainer's ranks (`job`: their group when they are not the
    whole job)."""
    with trainer.evaluation_weights():
        if dist.get_rank() == 0:
            record_evaluation(cfg, trainer, run_dir, done)
        elif trainer.engine.collective:
            # rank 0's engine peers join each of its generate calls (ODE, then the rollout sampler) with no
            # samples of their own; the other engines' ranks all do, so those calls run nothing
            for _ in range(1 + int(cfg.eval.rollout_sampler) + int(trainer.quantization.enabled)):
                trainer.engine.generate([], trainer.sampling_params())
        dist.barrier(group=job)


def record_evaluation(cfg: JobConfig, trainer: FlowGRPOTrainer, run_dir: Path, done: int) -> None:
    """Sample the held-out prompts (`cfg.eval`) with the ODE (and with the rollout's sampler when
    `eval.rollout_sampler`), save `eval/step_XXXX.npz` and a grid of the ODE's images, append to `eval.jsonl`;
    after the last step also draw `eval_before_after.png`. With a quantized rollout (`rollout.quantization`)
    the same prompts and seeds are also sampled by the ODE with the engine's quantizers off: `unquantized_*`
    keys and `quantized_reward_delta` (the quantized held-out figure minus the unquantized one)."""
    e = cfg.eval
    base = trainer.sampling_params()
    guidance = base.guidance_scale if e.guidance_scale is None else e.guidance_scale
    params = dataclasses.replace(base, num_steps=e.num_steps, guidance_scale=guidance, window_range=None,
                                 negative_prompt=base.negative_prompt if base.negative_prompt is not None
                                 else (" " if guidance > 1 else None))
    prompts, seeds = eval_samples(e.prompts + e.transfer_prompts, e.seeds_per_prompt, cfg.seed)
    result = evaluate(trainer.engine, trainer.reward_fn, prompts, seeds, params)
    folder = run_dir / "eval"
    folder.mkdir(exist_ok=True)
    result.save(folder / f"step_{done:04d}.npz")
    caps = reward_captions(result.prompts, result.rewards.tolist(), result.terms)
    save_samples(result.images, caps, folder / f"step_{done:04d}.png", cfg.logging.video_format)
    seen, transfer = set(cfg.prompts), set(e.transfer_prompts)
    summary = {"step": done, **result.summary(seen, transfer)}
    if e.rollout_sampler:
        sde = evaluate(trainer.engine, trainer.reward_fn, prompts, seeds, base, ode=False)
        summary.update({f"rollout_sampler_{k}": v for k, v in sde.summary(seen, transfer).items()})
    if trainer.quantization.enabled:
        with trainer.unquantized_rollout():
            plain = evaluate(trainer.engine, trainer.reward_fn, prompts, seeds, params)
        summary.update({f"unquantized_{k}": v for k, v in plain.summary(seen, transfer).items()})
        summary["quantized_reward_delta"] = summary["reward_mean"] - summary["unquantized_reward_mean"]
    summary = with_peak(summary, read_history(run_dir / "eval.jsonl"))
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write(json.dumps(summary) + "\n")
    first = folder / "step_0000.npz"
    if done == cfg.steps and done > 0 and first.exists():
        save_before_after_grid(EvalResult.load(first), result, run_dir / "eval_before_after.png",
                               transfer=transfer)
    tqdm.write(f"eval after {done} steps: " + ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if k != "step"))


def run(cfg: JobConfig, overwrite: bool = False) -> dict:
    """Train for `cfg.steps` RL steps (resuming if asked); returns a summary. Collective over all ranks.
    `overwrite`: clear the run folder's run artefacts first (`run_folder.check_run_dir` has checked the
    folder before any work). SIGTERM/SIGINT: the step finishes, a checkpoint is written and TrainingStopped
    is raised (on every rank)."""
    with StopRequests() as stops:
        try:
            return _run(cfg, overwrite, stops)
        finally:
            gc.unfreeze()  # what the run froze (below) is collectable again for whatever this process does next


def _close_run(bar: tqdm | None, writer: MetricsWriter | None, reward_fn: RewardFunction | None,
               trainer: object) -> None:
    """Close what a run opened (progress bar, metrics writer, reward client, the trainer's engine) before it ends
    early. Collective (the trainer's engine)."""
    if bar is not None:
        bar.close()
    if writer is not None:
        writer.close()
    if reward_fn is not None:
        reward_fn.close()
    trainer.close()


def build_trainer(cfg: JobConfig, groups, run_dir: Path, job_group=None) -> tuple[object, RewardFunction | None]:
    """The trainer of `cfg.model.family`'s kind and the reward client it scores with (None: the trainer scores
    in process). Collective (every rank; `job_group`: the trainer's ranks of a disaggregated job)."""
    family = get_family(cfg.model.family)
    if family.trainer is not None:  # a family with a trainer of its own names its module (data, not a branch)
        return importlib.import_module(family.trainer).build_trainer(cfg, groups, run_dir)
    if family.kind == "ar_dit":
        from megatron_omni.trainer.ar_dit import ARDiTTrainConfig, ARDiTTrainer, load_trajectory_reward

        vocab = int(family.config(cfg.model.preset).decoder["vocab_size"])
        return ARDiTTrainer(ARDiTTrainConfig.from_job(cfg), groups,
                            load_trajectory_reward(cfg.ar_dit.reward, vocab)), None
    pipeline = prepare_pipeline(cfg, run_dir)
    # A video family's samples reach the scorer as strips of reward.video_frames frames (its traits say video).
    video_frames = cfg.reward.video_frames if family.traits.video else None
    reward_fn = RewardFunction(cfg.reward.scorer, cfg.reward.url, cfg.reward.timeout_s, video_frames,
                               cfg.reward.options)
    return FlowGRPOTrainer(cfg, groups, pipeline, reward_fn, job_group), reward_fn


def _run(cfg: JobConfig, overwrite: bool, stops: StopRequests) -> dict:
    rank = dist.get_rank()
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        if overwrite and (removed := clear_run_dir(run_dir)):
            print(f"--overwrite: removed {', '.join(removed)} from {run_dir}")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "samples").mkdir(exist_ok=True)
    dist.barrier()
    p = cfg.parallel
    layout = ParallelLayout(tp=p.tp, ulysses=p.ulysses, ring=p.ring, pp=p.pp)
    placement = split_world(cfg.placement.mode, dist.get_world_size(), cfg.placement.rollout_ranks or None,
                            rollout_tp=cfg.rollout.tp if cfg.placement.mode == "disaggregated" else 1)
    loop = None
    if placement.disaggregated:
        # Every rank creates every group (collective), then each side goes its way: the rollout ranks serve until
        # the trainer stops them; the trainer's grid spans the trainer ranks only.
        sources = layout.resolve(len(placement.trainer_ranks)).stage_roots(placement.trainer_root)
        pgroups = build_placement_groups(placement, weight_sources=sources)
        groups = build_parallel_groups(layout, ranks=placement.trainer_range)
        if placement.role(rank) == "rollout":
            from megatron_omni.trainer.async_loop import serve_rollout

            serve_rollout(cfg, pgroups, prepare_pipeline(cfg, run_dir))
            return {"run_dir": str(run_dir), "role": "rollout"}
        from megatron_omni.trainer.async_loop import AsyncLoop, trainer_side

        trainer, reward_fn = build_trainer(trainer_side(cfg), groups, run_dir, pgroups.trainer)
        loop = AsyncLoop(cfg, trainer, pgroups)
        job = pgroups.trainer  # the trainer's own collectives (the rollout ranks join only the closing ones)
    else:
        groups = build_parallel_groups(layout)
        trainer, reward_fn = build_trainer(cfg, groups, run_dir)
        job = None

    start = 0
    in_flight: dict = {}
    folder = resume_folder(cfg.checkpoint.resume, run_dir)  # collective (the rollout ranks join)
    # The run id: the resumed checkpoint's (one run continues), else a new one (rank 0's, shared).
    shared = [run_id_of(folder) if folder is not None else None]
    if shared[0] is None:
        shared = [new_run_id()]
        dist.broadcast_object_list(shared, src=0, group=job)
    run_id = shared[0]
    if rank == 0:
        atomic_files.write_text(run_dir / "config.json", json.dumps({"run_id": run_id, **to_dict(cfg)}, indent=2))
    if folder is not None:
        # An asynchronous run's root reads the steps its checkpoint saved ahead (when it saved any).
        ahead = ((ASYNC_IN_FLIGHT,) if loop is not None and rank == loop.root
                 and read_common(folder)["data"].get("in_flight") else ())
        try:
            common = load_checkpoint(folder, trainer.model, trainer.optimizer, trainer.scheduler,
                                     sharded_state=trainer.sharded_state, ema=trainer.ema,
                                     identity=trainer.checkpoint_identity, copies=trainer.extra_copies,
                                     objects=ahead)
        except ConfigError:
            if loop is None:  # every rank read the same recorded identity and refused it: they close together
                _close_run(None, None, reward_fn, trainer)
            raise
        start = common["step"]
        in_flight = common.get("objects", {}).get(ASYNC_IN_FLIGHT, {})
        trainer.guard.bad_steps = int(common.get("bad_steps", 0))
        trainer.sync_weights()
        if rank == 0:
            # Records written after the checkpoint (before a crash) are dropped: the resumed run redoes them.
            atomic_files.write_jsonl(run_dir / "metrics.jsonl", common["metrics_history"])
            evals = read_history(run_dir / "eval.jsonl")
            if evals:
                atomic_files.write_jsonl(run_dir / "eval.jsonl", [e for e in evals if e["step"] <= start])
            print(f"resumed from {folder} at step {start}")
    elif rank == 0:
        # A new run (--resume auto-or-new found no checkpoint): an earlier attempt's records are not this run's.
        for name in ("metrics.jsonl", "eval.jsonl"):
            (run_dir / name).unlink(missing_ok=True)

    writer = None
    if rank == 0:
        writer = MetricsWriter(run_dir, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                               to_dict(cfg))

    def evaluation(done: int) -> None:
        if loop is not None:
            loop.evaluation_sync()  # the trainer's own engine samples it: bring it to the trained weights
        run_evaluation(cfg, trainer, run_dir, done, job)

    def evaluation_due(done: int) -> bool:
        every = cfg.eval.every
        return bool(cfg.eval.prompts) and (done in (0, cfg.steps) or bool(every and done % every == 0))

    if evaluation_due(start):
        # A resumed run redoes the evaluation its checkpoint's step owed when the job died before recording it
        # (the evaluation follows the checkpoint).
        owed = [True]
        if start > 0:
            if rank == 0:
                owed = [not any(e["step"] == start for e in read_history(run_dir / "eval.jsonl"))]
            dist.broadcast_object_list(owed, src=0, group=job)
        if owed[0]:
            evaluation(start)
    # the bar names the update rule (algorithm.name) of the DiT trainer, the trainer otherwise
    name = (cfg.algorithm.name if isinstance(trainer, FlowGRPOTrainer)
            else type(trainer).__name__.removesuffix("Trainer"))
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=name, unit="step", disable=rank != 0,
               dynamic_ncols=True)
    if reward_fn is not None:
        reward_fn.progress = bar  # its postfix shows "waiting for rewards: N outstanding" while the server scores
    if loop is not None:
        loop.start(start, in_flight)
    traits = get_family(cfg.model.family).traits
    panels = traits.sample_panels if traits is not None else None
    # Everything built so far (the ~5000 modules torch, megatron-core and diffusers import, the model, the engine)
    # lives to the end of the run: the collector need not walk it again at every full collection (a 6-step tiny
    # run: 16.0 and 14.7 CPU seconds against 16.8 and 16.7 without).
    gc.freeze()
    for step in bar:
        try:
            result = trainer.train_step(step) if loop is None else loop.train_step(step)
        except (RolloutRankLost, RolloutRankFailed, StalenessError):
            loop.abandon()
            raise
        except LogpGapError:
            # raised on every rank at once (its mean is all-reduced): they close together, leaving no engine behind
            # in a process that runs again (a rank pool, a notebook)
            if loop is None:
                _close_run(bar, writer, reward_fn, trainer)
            raise
        if rank == 0:
            writer.log(step, result.metrics)
            bar.set_postfix({k: f"{result.metrics[k]:.3g}" for k in SHOWN if k in result.metrics})
            every = cfg.logging.image_every
            if step == cfg.steps - 1 or (every and step % every == 0):
                images, shown = result.images, result.prompts
                if panels is not None:  # e.g. an edit family's source | output, captioned with the instruction
                    images, shown = panels(result.prompts, result.images)
                caps = reward_captions(shown, result.rewards.tolist(),
                                       getattr(getattr(trainer, "reward_fn", None), "terms", None))
                save_samples(images, caps, run_dir / "samples" / f"step_{step:04d}.png",
                             cfg.logging.video_format)
        done = step + 1
        # The step boundary: every rank learns whether any rank was signalled, so all stop after this step.
        stop = stops.requested(job)
        if stop or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.steps:
            # An asynchronous run saves the steps sampled ahead, and its rollout ranks join the save.
            objects = loop.checkpoint(done) if loop is not None else None
            ahead = sorted(objects[ASYNC_IN_FLIGHT]) if objects else []
            common = {"step": done, "data": {"next_step": done, "prompts_seen": done * cfg.rollout.prompts_per_step,
                                             "in_flight": ahead},
                      "bad_steps": trainer.guard.bad_steps, "identity": trainer.checkpoint_identity,
                      "metrics_history": read_history(run_dir / "metrics.jsonl") if rank == 0 else []}
            saved = save_checkpoint(run_dir, done, trainer.model, trainer.optimizer, trainer.scheduler, common,
                                    cfg.checkpoint.keep, content_metadata=trainer.content_metadata(done),
                                    sharded_state=trainer.sharded_state, ema=trainer.ema, run_id=run_id,
                                    copies=trainer.extra_copies, objects=objects)
        stopped = (stops.signame, done, str(saved)) if stop and done < cfg.steps else None
        if loop is not None and (stopped or done == cfg.steps):
            loop.finish(stopped)  # the rollout ranks stop (with the trainer's stop, when it stops on a signal)
        if stopped:  # a signal during the last step: the run is complete anyway
            _close_run(bar, writer, reward_fn, trainer)
            raise TrainingStopped(*stopped)
        if evaluation_due(done):
            evaluation(done)
    if reward_fn is not None:
        reward_fn.close()
    trainer.close()
    summary = {"run_dir": str(run_dir)}
    if rank == 0:
        writer.close()
        history = read_history(run_dir / "metrics.jsonl")
        evals = read_history(run_dir / "eval.jsonl")
        save_reward_curve(history, run_dir / "reward_curve.png", evals)
        summary.update(first_reward=history[0]["reward_mean"], last_reward=history[-1]["reward_mean"],
                       steps=len(history))
        if len(evals) >= 2 and evals[0]["step"] == 0:
            summary.update(eval_before=evals[0], eval_after=evals[-1])
    dist.barrier()  # the whole job's (a disaggregated job's rollout ranks wait here after `finish`)
    return summary

