"""`--dry-run`: the thin adapter from a JobConfig to the planner's plain values (`megatron_omni.planner`).

The planner sits below the trainer and never reads a JobConfig; this file maps one onto a `JobPlan`, turns
the planner's layout errors into config errors (exit 2) and gives the planner's advice a way to plan a changed
config exactly as a dry run with those `--set` overrides would.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.planner import (
    DEFAULT_MFU,
    DTYPE_BYTES,
    JobPlan,
    LoRASpec,
    Precision,
    RolloutSpec,
    StateCopy,
    Workload,
    measured_mfu,
)
from megatron_omni.planner.arch import job_arch
from megatron_omni.planner.dry_run import dry_run as planner_dry_run
from megatron_omni.planner.video import VideoWorkload, choose_cp, plan_video
from megatron_omni.trainer.config import ConfigError, JobConfig, apply_overrides, trainer_world_size
from megatron_omni.trainer.config_checks import placement_limits
from model_providers import get_family


def _model_config(cfg: JobConfig) -> tuple[dict[str, Any] | str, str]:
    """The transformer's diffusers config for planning and where it came from: the pipeline folder's
    transformer/config.json when it is at hand, else `model.preset` (so a job can be planned on a laptop)."""
    hf_config = get_family(cfg.model.family).config
    if cfg.model.pipeline == "tiny":
        return get_family(cfg.model.family).tiny_pipeline.transformer_config(), "tiny pipeline"
    path = Path(cfg.model.pipeline) / "transformer" / "config.json"
    if path.exists():
        model = json.loads(path.read_text())
        if cfg.model.preset is not None and hf_config(model) != hf_config(cfg.model.preset):
            raise ConfigError(f"model.preset={cfg.model.preset!r} does not match {path}: "
                              f"{hf_config(cfg.model.preset)} != {hf_config(model)}")
        return model, str(path)
    if cfg.model.preset is None:
        raise ConfigError(f"model.pipeline={cfg.model.pipeline!r}: no {path} to plan with; point it at a diffusers "
                          "pipeline folder or set model.preset (e.g. --set model.preset=20b)")
    try:
        hf_config(cfg.model.preset)
    except KeyError as exc:
        raise ConfigError(f"model.preset: {exc.args[0]}") from None
    return cfg.model.preset, f"preset {cfg.model.preset!r} ({path} not found here)"


def job_plan(cfg: JobConfig, world_size: int, gpu: str, gpus_per_node: int = 8, reward_gpus: int = 0,
             mfu: float = DEFAULT_MFU, mfu_source: str | None = None) -> JobPlan:
    """What the trainer does (trainer/flowgrpo.py), as the planner's plain values: the engine is colocated with
    the trainer and every rollout group of rollout.tp ranks rolls out its share of the images; disaggregated
    (placement.mode), `world_size` less placement.rollout_ranks train and those roll out (`JobPlan.rollout_gpus`).
    The embedded diffusers engine keeps its full weights resident; vLLM-Omni sleeps during the update. The tiny
    pipeline's text encoder and VAE are negligible. The family's cost model (`planner.arch`) gives the text
    stream: SD3.5's CLIP 77 + T5 `rollout.max_sequence_length` tokens, Qwen-Image's 256-token prompt budget (an
    edit's plus the source's vision tokens, its source latents in the image stream)."""
    model, source = _model_config(cfg)
    family = cfg.model.family
    arch, condition_text, condition_tokens = job_arch(family, model, cfg.model.pipeline, cfg.rollout.height,
                                                      cfg.rollout.width)
    text_tokens = Workload.text_tokens + condition_text
    if arch.t5_padded:  # CLIP's 77 tokens before T5's (SD3.5); T5's alone (FLUX.1, CLIP pooled only)
        text_tokens = arch.fixed_text_tokens + cfg.rollout.max_sequence_length
    r, p = cfg.rollout, cfg.parallel
    # Disaggregated: the planner's world is the trainer ranks; the last placement.rollout_ranks roll out.
    rollout_gpus = cfg.placement.rollout_ranks if cfg.placement.mode == "disaggregated" else 0
    limits = tuple(placement_limits(cfg)) if rollout_gpus else ()
    world_size = trainer_world_size(cfg, world_size)
    dp = world_size // (p.tp * p.ulysses * p.ring * p.pp)
    vllm = r.engine == "vllm_omni"
    # RolloutSpec counts the pipeline's other weights at the rollout's dtype: a VAE in another one
    # (`rollout.vae_dtype`, e.g. flow_grpo's fp32 under bf16) counts as that many more (or fewer) of them
    vae_bytes = _vae_bytes(cfg) or DTYPE_BYTES[r.dtype]
    extra = arch.extra_params + arch.vae_params * (vae_bytes - DTYPE_BYTES[r.dtype]) // DTYPE_BYTES[r.dtype]
    rollout = RolloutSpec(tp=r.tp, sleeps=vllm, in_process=not vllm, extra_params=0 if cfg.model.pipeline == "tiny"
                          else extra)
    precision = Precision.of(cfg.model.params_dtype, r.dtype, cfg.optim.distributed_optimizer)
    per_replica = r.prompts_per_step * r.group_size // cfg.optim.mini_batches // dp
    workload = Workload(height=r.height, width=r.width, sampling_steps=r.num_steps, window=r.window_size,
                        prompts=r.prompts_per_step, group_size=r.group_size, mini_batches=cfg.optim.mini_batches,
                        micro_batch_size=cfg.optim.micro_batch_size or max(per_replica, 1),
                        cfg=r.guidance_scale > 1, recompute_old_logprob=cfg.algorithm.old_logprob == "recompute",
                        text_tokens=text_tokens, condition_tokens=condition_tokens)
    # The frozen reference of the KL term (in the parameters' dtype) and the EMA of the weights (fp32): each one
    # more copy of this rank's shard (not in the memory model's total). With LoRA the reference is the same model
    # with its adapters off (no copy), and the EMA is refused (config_checks.check_lora).
    lora = cfg.model.lora
    copies = []
    if cfg.algorithm.beta > 0 and not lora.enabled:
        copies.append(StateCopy(f"KL reference (algorithm.beta={cfg.algorithm.beta:g})", precision.param_bytes))
    if cfg.optim.ema_decay > 0:
        copies.append(StateCopy(f"EMA of the weights (optim.ema_decay={cfg.optim.ema_decay:g}, fp32)", 4))
    return JobPlan(model=arch, model_source=source,
                   layout=ParallelLayout(tp=p.tp, ulysses=p.ulysses, ring=p.ring, pp=p.pp),
                   world_size=world_size, gpu=gpu, workload=workload, rollout=rollout, precision=precision,
                   recompute=cfg.model.recompute or "none", mfu=mfu, mfu_source=mfu_source,
                   gpus_per_node=gpus_per_node, reward_gpus=reward_gpus, state_copies=tuple(copies),
                   rollout_engine=r.engine, params_dtype=cfg.model.params_dtype, rollout_dtype=r.dtype,
                   backend=cfg.model.backend,
                   lora=LoRASpec(lora.rank, tuple(lora.target_patterns()), lora.alpha) if lora.enabled else None,
                   rollout_gpus=rollout_gpus, limits=limits)


def dry_run(cfg: JobConfig, world_size: int, gpu: str, gpus_per_node: int = 8, reward_gpus: int = 0,
            mfu_from: str | None = None) -> int:
    """Print the planner's report and the bridge plan for this (validated) job; needs no GPU and loads no
    weights. `mfu_from`: a JSON written by tools/gpu_check.sh whose measured MFU replaces the assumed one.
    Returns 0 when it fits, 3 when it does not (with the changes the planner checked fit); raises ConfigError
    for an invalid config or layout."""
    family = get_family(cfg.model.family)
    if family.kind == "mot":
        return mot_dry_run(cfg, world_size, gpu)
    if family.kind != "dit":
        raise ConfigError(f"--dry-run: the planner models DiT families; model.family={cfg.model.family} "
                          "has no cost model yet")
    if not family.traits.planned:
        raise ConfigError(f"--dry-run: the planner has no cost model (memory, FLOPs) for model.family="
                          f"{cfg.model.family} yet; `--check` validates the config without planning it")
    mfu = DEFAULT_MFU
    if mfu_from is not None:
        try:
            mfu = measured_mfu(mfu_from)
        except ValueError as exc:
            raise ConfigError(f"--mfu-from: {exc}") from None

    if family.traits.video:
        return video_dry_run(cfg, world_size, gpu, gpus_per_node, reward_gpus, mfu)

    def build(c: JobConfig, world: int) -> JobPlan:
        return job_plan(c, world, gpu, gpus_per_node, reward_gpus, mfu, mfu_from)

    def replan(overrides: tuple[str, ...], world: int) -> JobPlan:
        changed = apply_overrides(copy.deepcopy(cfg), list(overrides))
        changed.validate(world)
        return build(changed, world)

    job = build(cfg, world_size)
    try:
        status = planner_dry_run(job, replan)
    except LayoutError as exc:
        raise ConfigError(f"layout: {exc}") from exc
    if job.limits:  # planned and printed; the trainer cannot run it yet (config_checks.placement_limits)
        raise ConfigError(f"{job.limits[0]} (the dry run above plans it; a launch refuses it)")
    return status


def rollout_experts(cfg: JobConfig) -> int:
    """Transformers the job's rollout engine holds: the folder's (two for a Wan2.2 A14B folder: `transformer_2` and
    `boundary_ratio` in its model_index.json) when it is at hand, else the preset's (`EXPERTS` of the family's
    presets module), else 1."""
    index = Path(cfg.model.pipeline) / "model_index.json"
    if cfg.model.pipeline != "tiny" and index.is_file():
        second = json.loads(index.read_text()).get("transformer_2")
        return 2 if second and second[0] is not None else 1
    import importlib

    try:
        experts = importlib.import_module(f"model_providers.{cfg.model.family}.presets").EXPERTS
    except (ImportError, AttributeError):
        return 1
    return int(experts.get(cfg.model.preset, 1))


def video_workload(cfg: JobConfig, world_size: int) -> VideoWorkload:
    """The planner's view of a video job's step (`planner.video`): Wan pads every prompt to the text length."""
    r, p = cfg.rollout, cfg.parallel
    dp = max(world_size // (p.tp * p.ulysses * p.ring * p.pp), 1)
    per_replica = r.prompts_per_step * r.group_size // cfg.optim.mini_batches // dp
    return VideoWorkload(frames=r.num_frames, height=r.height, width=r.width,
                         text_tokens=r.text_length or r.max_sequence_length, sampling_steps=r.num_steps,
                         window=r.window_size, prompts=r.prompts_per_step, group_size=r.group_size,
                         mini_batches=cfg.optim.mini_batches,
                         micro_batch_size=cfg.optim.micro_batch_size or max(per_replica, 1),
                         recompute_old_logprob=cfg.algorithm.old_logprob == "recompute",
                         cfg=r.guidance_scale > 1)


def _vae_bytes(cfg: JobConfig) -> int | None:
    """Bytes per VAE parameter of `rollout.vae_dtype` (None for auto: the rollout's dtype)."""
    return None if cfg.rollout.vae_dtype == "auto" else DTYPE_BYTES[cfg.rollout.vae_dtype]


def planner_cp(cfg: JobConfig, world_size: int, gpu: str = "H200", max_cp: int = 8, mfu: float = DEFAULT_MFU,
               model: dict[str, Any] | str | None = None):
    """The planner's plan (`planner.video.choose_cp`) at the smallest Ulysses degree that fits a video job's clip
    at its tp, pp, precision and recompute (`model`: its transformer config, default `_model_config`'s); raises
    LayoutError when none up to `max_cp` fits. What a video recipe sets parallel.ulysses from."""
    p, r = cfg.parallel, cfg.rollout
    return choose_cp(model if model is not None else _model_config(cfg)[0], world_size,
                     video_workload(cfg, world_size), tp=p.tp, pp=p.pp, gpu=gpu,
                     precision=Precision.of(cfg.model.params_dtype, r.dtype, cfg.optim.distributed_optimizer),
                     recompute=cfg.model.recompute or "none", mfu=mfu, max_cp=max_cp,
                     rollout_experts=rollout_experts(cfg), vae_bytes=_vae_bytes(cfg))


def video_dry_run(cfg: JobConfig, world_size: int, gpu: str, gpus_per_node: int, reward_gpus: int,
                  mfu: float) -> int:
    """The dry run of a video family (`planner.video`): the clip's tokens, the layout, per-GPU memory and step
    time at the config's layout, and the Ulysses degree the planner would choose at its tp and pp (the smallest
    that fits). Returns 0 when the config's layout fits, 3 when not; ConfigError for a layout that cannot run."""
    model, source = _model_config(cfg)
    p, r = cfg.parallel, cfg.rollout
    precision = Precision.of(cfg.model.params_dtype, r.dtype, cfg.optim.distributed_optimizer)
    recompute = cfg.model.recompute or "none"
    work = video_workload(cfg, world_size)
    try:
        got = plan_video(model, ParallelLayout(tp=p.tp, ulysses=p.ulysses, ring=p.ring, pp=p.pp), world_size, work,
                         gpu, precision, recompute, mfu, rollout_experts=rollout_experts(cfg),
                         vae_bytes=_vae_bytes(cfg))
    except LayoutError as exc:
        raise ConfigError(f"layout: {exc}") from exc
    try:
        chosen = planner_cp(cfg, world_size, gpu, gpus_per_node, mfu, model)
        choice = f"ulysses={chosen.layout.ulysses} (the smallest Ulysses degree that fits at tp={p.tp}, pp={p.pp})"
    except LayoutError as exc:
        chosen, choice = None, f"none fits: {exc}"
    lay, m, gib = got.layout, got.memory, 2**30
    experts = rollout_experts(cfg)
    print(f"dry run: world size {world_size} trainer ranks + {reward_gpus} reward GPUs, model from {source} "
          f"(model.family={cfg.model.family}), {gpu}"
          + (f"; {experts} experts of this shape in the rollout engine, one trained" if experts > 1 else ""))
    print(f"clip: {work.frames} frames {work.height}x{work.width} -> patch grid {'x'.join(map(str, got.grid))} = "
          f"{got.video_tokens} video tokens, {work.text_tokens} text tokens; {work.videos} clips per step")
    print(f"layout: tp={lay.tp} ulysses={lay.ulysses} ring={lay.ring} pp={lay.pp} dp={lay.dp}, recompute "
          f"{recompute}, precision model {cfg.model.params_dtype} / rollout {r.dtype} ({r.engine} engine)")
    print(f"context parallel chosen by the planner: {choice}")
    print(f"memory per GPU: {m.total / gib:.1f} GiB of {m.capacity / gib:.1f} (parameters {m.parameters / gib:.1f}, "
          f"gradients {m.gradients / gib:.1f}, optimizer states {m.optimizer_states / gib:.1f}, activations "
          f"{m.activations / gib:.1f}, rollout weights {m.rollout_weights / gib:.1f}, rollout activations "
          f"{m.rollout_activations / gib:.1f}, reserve {m.reserve / gib:.1f})")
    print(f"step time: {got.step_s:.1f} s (rollout {got.rollout_s:.1f}, old log-probs {got.old_logprob_s:.1f}, train "
          f"{got.train_s:.1f}) at MFU {mfu:.2f}; {got.videos_per_s_per_gpu(work.videos):.4f} videos/s/GPU")
    print(f"of which: collectives {got.communication_s:.1f} s, text encoder (umT5-XXL) {got.text_encoder_s:.1f} s, "
          f"VAE {got.vae_s:.1f} s; true CFG {'on: two rows per clip' if work.cfg else 'off'}")
    if m.fits:
        print("dry run OK: the layout is valid for this world size and fits")
        return 0
    print(f"dry run: does not fit in {gpu} memory" + (f"; the planner's choice fits: --set parallel.ulysses="
                                                      f"{chosen.layout.ulysses}" if chosen is not None else ""))
    return 3


def mot_dry_run(cfg: JobConfig, world_size: int, gpu: str) -> int:
    """The dry run of a Mixture-of-Transformers family (BAGEL; `planner.mot.plan_mot`): the model's config from
    the folder when it is at hand (its `llm_config.json` / `config.json`), else `model.preset`; every tp the query
    groups and the world admit, planned for the job's workload (images per step, steps, window, CFG, precision,
    the KL reference and EMA copies); the config's tp judged. Returns 0 when the config's tp fits, 3 when not (with
    the smallest tp that fits); ConfigError for a tp the model does not admit."""
    from megatron_omni.planner.mot import GIB, plan_mot
    from megatron_omni.trainer.bagel import plan_inputs

    model, source, prompt_tokens = plan_inputs(cfg)
    r, p, o, lora = cfg.rollout, cfg.parallel, cfg.optim, cfg.model.lora
    bf16 = cfg.model.params_dtype == "bf16"
    if lora.enabled and lora.targets is not None:
        raise ConfigError("model.lora.targets: the MoT planner counts the default targets (every generation-expert "
                          "linear); unset it for a dry run")
    try:
        plans = plan_mot(model, gpu, world_size, r.height, r.width, prompt_tokens=prompt_tokens,
                         samples=r.prompts_per_step * r.group_size, num_steps=r.num_steps, window=r.window_size,
                         cfg=r.guidance_scale > 1, bf16=bf16, distributed_optimizer=o.distributed_optimizer,
                         rollout_bytes=2 if r.dtype == "bf16" else 4,
                         train="lora" if lora.enabled else "both" if cfg.model.bagel_experts == "both" else "gen",
                         lora_rank=lora.rank, cp=p.ulysses * p.ring, rollout_sharded=r.tp > 1)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"plan: {exc}") from None
    print(f"dry run: world size {world_size} trainer ranks (the rollout runs in the trainer's processes), model "
          f"from {source} (model.family={cfg.model.family}), {gpu}")
    print(f"workload: {r.prompts_per_step * r.group_size} images per step of {r.height}x{r.width}, {r.num_steps} "
          f"steps, window {r.window_size}, {'text CFG' if r.guidance_scale > 1 else 'no CFG'}, prompts up to "
          f"{prompt_tokens} tokens; model {cfg.model.params_dtype}, rollout {r.dtype}; "
          + (f"LoRA rank {lora.rank} on the generation expert's linears trains (the base frozen, counted once)"
             if lora.enabled else "both experts train (model.bagel_experts=both)" if cfg.model.bagel_experts == "both"
             else "the generation expert trains"))
    print("memory per GPU: for each tp, weights (both experts) + grads and optimizer states (the trained share"
          + (", distributed optimizer over dp" if o.distributed_optimizer else "") + ") + activations + the rollout's "
          "copy")
    copies = []
    if cfg.algorithm.beta > 0 and not lora.enabled:  # with LoRA the reference is the base: the adapters off
        copies.append((f"KL reference (algorithm.beta={cfg.algorithm.beta:g}, the initial model)", 2 if bf16 else 4))
    if o.ema_decay > 0:
        copies.append((f"EMA of the weights (optim.ema_decay={o.ema_decay:g}, fp32)", 4))
    fitting, mine = [], None
    for plan in plans:
        extra = sum(plan.params * width for _, width in copies)  # whole copies of the rank's shards
        total = plan.total + extra
        lines = plan.lines()
        for label, width in copies:
            lines.append(f"  + {label}: {plan.params * width / GIB:.1f} GiB")
        if copies:
            lines.append(f"  = {total / GIB:.1f} GiB of {plan.capacity / GIB:.1f} GiB: "
                         f"{'fits' if total <= plan.capacity else 'does not fit'}")
        print("\n".join(lines))
        if total <= plan.capacity:
            fitting.append(plan)
        if plan.tp == p.tp:
            mine = (plan, total <= plan.capacity)
    if mine is None:
        raise ConfigError(f"layout: parallel.tp={p.tp} is not one the model admits on {world_size} GPUs (tp x cp must "
                          f"divide the world size and tp the key/value heads): {[q.tp for q in plans]}")
    plan, fits = mine
    print(f"bridge: full tensors gathered over the trainer's tp into vLLM-Omni's BAGEL pipeline at rollout tp {r.tp}, "
          f"{plan.sync_bytes / GIB:.1f} GiB per sync, coverage-checked")
    if plan.cp > 1:
        print(f"layout: tp={plan.tp} cp={plan.cp} dp={plan.dp} (parallel.tp, parallel.ulysses x ring)")
        print(f"context parallelism: cp {plan.cp} splits the generation tokens (activations / {plan.cp}) and "
              f"all-gathers their k/v per layer: {plan.kv_gather_bytes / 2**20:.1f} MiB received per layer and sample,"
              f" reduce-scattered in backward, {plan.cp_comm_s:.1f} s per step")
    else:
        print(f"layout: tp={plan.tp} dp={plan.dp} (parallel.tp)")
        print("context parallelism: cp 1 (parallel.ulysses x ring > 1 splits the generation tokens' activations over "
              "cp and all-gathers their k/v per layer)")
    print(f"step time: about {plan.step_s:.0f} s at MFU 0.3 (FLOPs"
          + (" + the k/v collectives over cp" if plan.cp > 1 else " only") + "), "
          f"{r.prompts_per_step * r.group_size / plan.step_s / world_size:.3f} images/s/GPU")
    print("reference (VeRL-Omni and UniRL train BAGEL; no per-GPU throughput of theirs is recorded here)")
    if fits:
        print("dry run OK: the layout is valid for this world size and fits")
        return 0
    hint = (f"the smallest tp that fits: --set parallel.tp={fitting[0].tp}" if fitting else
            "no tp fits: use a GPU with more memory or more GPUs")
    print(f"dry run: tp={plan.tp} does not fit in {gpu} memory; {hint}")
    return 3
