"""The time and memory model of the dry-run planner: from a model preset, a parallel layout and a FlowGRPO
workload, predict per-GPU memory and step time before a job is queued. Pure functions; no GPU, no process group.

Time model (stated, so a reader can redo it by hand):
- compute: FLOPs (`planner.flops`) / (GPUs * peak bf16 FLOP/s * MFU);
  rollout = T forward passes per image (CFG doubles them) + one text-encoder pass per prompt;
  old log-probs = one forward per trained step (W per image) in the trainer layout;
  training = forward + backward = 3 forwards per trained step, + 1 forward with full recompute, + the
  attention part (QKV projection + attention) with selective recompute;
  pipeline bubble: x (1 + (pp - 1) / micro-batches) per mini-batch (1F1B);
- communication that Megatron does not overlap with compute, at link bandwidth * efficiency: TP
  all-reduces (2 per stream per block forward, 2 backward), Ulysses all-to-alls (Q, K, V, out of the
  image stream; text output gather), the gradient reduce-scatter and parameter all-gather of the
  distributed optimizer once per mini-batch. Ring attention's K/V passing is assumed hidden behind
  compute. Reward scoring runs on its own GPUs and overlaps generation; VAE decode is not counted;
- weight sync (once per step, after the update): the rollout copy's bytes per rollout GPU, at HBM bandwidth
  when an in-process engine's layout equals the trainer's (direct mode: a local copy of the own shard), else
  at link bandwidth (full mode: gathered over the trainer's tp and pp);
- a colocated engine that sleeps (vLLM-Omni) frees its weights during the update, so its weights count in
  the rollout phase's memory only; the embedded diffusers engine keeps them resident;
- LoRA (`lora`, rank > 0): the base stays as it is (frozen, in the parameters' dtype) beside the adapters;
  gradients, main params and Adam moments (and the distributed optimizer's collectives) are the adapters'
  only; activations gain the adapters' [tokens, r] intermediates. Training: the forward adds the adapters'
  FLOPs; the backward still computes the base's input gradients (1 forward of its GEMMs instead of 2: no
  weight-gradient GEMMs) and attention's (2 forwards, no weights), plus the adapters' input and weight
  gradients (2 of their forwards). For the 20B at 512x512 (attention ~7% of a forward) the backward is then
  ~0.55 of a full one and forward + backward ~0.71 of full fine-tuning's ~3 forwards, i.e. about 2/3. Not
  modelled: the adapters' own small tp collectives ([tokens, r]), and the rollout and weight sync, which are
  counted as full fine-tuning's (merged full weights: `rollout.lora_sync=merge`; an adapter-only sync is
  smaller).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.planner.arch import DiTArch, arch_of
from megatron_omni.planner.flops import forward_flops, image_tokens, lora_forward_flops
from megatron_omni.planner.memory import (
    GIB,
    RECOMPUTE_MODES,
    MemoryReport,
    lora_activation_bytes,
    lora_adapter_counts,
    rank_buffer_counts,
    rank_parameter_counts,
    rollout_activation_bytes,
    rollout_parameter_count,
    training_activation_bytes,
)
from megatron_omni.planner.report import LoRAReport, PlanReport, TimeReport
from megatron_omni.planner.specs import (
    DEFAULT_MFU,
    GPUS,
    GPUSpec,
    LoRASpec,
    Precision,
    RolloutSpec,
    Workload,
)


def _positive(**values: Any) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"{name}={v!r} must be a positive integer")


def validate(
    model: str | dict[str, Any] | DiTArch, layout: ParallelLayout, world_size: int, workload: Workload,
    rollout: RolloutSpec,
) -> tuple[ParallelLayout, int, int]:
    """Check that the job can run; returns (layout with dp resolved, image tokens, micro-batches per
    mini-batch per replica). Image tokens are the generated image's plus `workload.condition_tokens` (an edit's
    source latents, in the same stream). Raises LayoutError naming the size that is wrong."""
    w = workload
    _positive(sampling_steps=w.sampling_steps, window=w.window, prompts=w.prompts, group_size=w.group_size,
              mini_batches=w.mini_batches, micro_batch_size=w.micro_batch_size, text_tokens=w.text_tokens,
              rollout_tp=rollout.tp, rollout_batch=rollout.batch)
    if w.window > w.sampling_steps:
        raise LayoutError(f"window {w.window} is longer than the {w.sampling_steps} sampling steps")
    if w.condition_tokens < 0:
        raise LayoutError(f"condition_tokens={w.condition_tokens} must be >= 0")
    a = arch_of(model)
    cfg = a.config
    resolved = layout.resolve(world_size)
    try:
        tokens = image_tokens(a, w.height, w.width) + w.condition_tokens
    except ValueError as e:
        raise LayoutError(str(e)) from e
    resolved.validate_model(num_heads=cfg["num_attention_heads"], num_layers=a.blocks,
                            image_tokens=tokens)
    dp = resolved.dp
    per_mini = w.images // w.mini_batches
    if w.images % w.mini_batches:
        raise LayoutError(f"{w.images} images per step (prompts x group) are not divisible by "
                          f"{w.mini_batches} mini-batches")
    if per_mini % dp:
        raise LayoutError(f"{per_mini} images per mini-batch are not divisible by dp={dp} "
                          f"(world {world_size} / tp*cp*pp {resolved.model_parallel_size})")
    samples = per_mini // dp * w.window
    if samples % w.micro_batch_size:
        raise LayoutError(f"{samples} trained samples per mini-batch per replica ({per_mini // dp} images x window "
                          f"{w.window}) are not divisible by micro-batch size {w.micro_batch_size}")
    if cfg["num_attention_heads"] % rollout.tp:
        raise LayoutError(f"attention heads {cfg['num_attention_heads']} are not divisible by rollout tp="
                          f"{rollout.tp}")
    rollout_gpus = world_size if rollout.colocated else rollout.gpus
    if rollout_gpus is None:
        raise LayoutError("a rollout engine that is not colocated needs its own GPU count (rollout.gpus)")
    _positive(rollout_gpus=rollout_gpus)
    if rollout_gpus % rollout.tp:
        raise LayoutError(f"{rollout_gpus} rollout GPUs are not divisible by rollout tp={rollout.tp}")
    if rollout.replicas is not None:
        _positive(rollout_replicas=rollout.replicas)
        if rollout.replicas * rollout.tp > rollout_gpus:
            raise LayoutError(f"{rollout.replicas} rollout replicas x tp={rollout.tp} need more than the "
                              f"{rollout_gpus} rollout GPUs")
    return resolved, tokens, samples // w.micro_batch_size


def _allreduce_s(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bw


def _alltoall_s(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n == 1 else (n - 1) / n * nbytes / bw


def plan(
    model: str | dict[str, Any],
    layout: ParallelLayout,
    world_size: int,
    gpu: GPUSpec | str = "H200",
    workload: Workload | None = None,
    *,
    rollout: RolloutSpec | None = None,
    precision: Precision | None = None,
    recompute: str = "full",
    mfu: float = DEFAULT_MFU,
    link_efficiency: float = 0.7,
    reserve_bytes: int = 4 * GIB,
    gpus_per_node: int = 8,
    reward_gpus: int = 0,
    lora: LoRASpec | None = None,
) -> PlanReport:
    """Predict per-GPU memory and step time of a FlowGRPO job; raises LayoutError for impossible layouts.

    model: a Qwen-Image preset name or diffusers config; world_size: trainer ranks; gpu: a `GPUSpec` or a
    key of `GPUS`; mfu: the assumed model FLOPs utilisation of dense compute; link_efficiency: achieved
    fraction of link bandwidth in collectives; reserve_bytes: per-GPU memory not available to tensors;
    lora: low-rank adapters on a frozen base (None or rank 0: full fine-tuning).
    """
    workload = workload or Workload()
    rollout = rollout or RolloutSpec()
    precision = precision or Precision()
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise LayoutError(f"unknown GPU kind {gpu!r}; known: {sorted(GPUS)} (or pass a GPUSpec)")
        gpu = GPUS[gpu]
    if recompute not in RECOMPUTE_MODES:
        raise LayoutError(f"unknown recompute mode {recompute!r}; known: {RECOMPUTE_MODES}")
    for name, v in (("mfu", mfu), ("rollout.mfu", rollout.mfu if rollout.mfu is not None else mfu),
                    ("link_efficiency", link_efficiency)):
        if not 0 < v <= 1:
            raise LayoutError(f"{name}={v} must be in (0, 1]")
    lay, s_img, micro = validate(model, layout, world_size, workload, rollout)
    a = arch_of(model)
    w, cfg = workload, a.config
    tp, cp, pp, dp = lay.tp, lay.cp, lay.pp, lay.dp
    a.check_layout(tp, cp, pp, recompute)
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None and a.single_layers:
        raise LayoutError(f"the planner has no LoRA cost model for the {a.family} model's single-stream blocks yet: "
                          "plan it without LoRA")
    adapters = None
    if lora is not None:
        try:
            adapters = lora_adapter_counts(a, tp, pp, lora.rank, lora.targets)
        except ValueError as e:
            raise LayoutError(str(e)) from e
    warnings: list[str] = []
    if tp * lay.ulysses > gpus_per_node:
        warnings.append(f"tp*ulysses = {tp * lay.ulysses} spans more than one {gpus_per_node}-GPU node: "
                        "its collectives cross the network (modelled at network bandwidth)")
    flops = forward_flops(a, s_img, w.text_tokens)
    cfg_x = 2 if w.cfg else 1
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    blocks_per_stage = a.blocks // pp  # FLUX: its double and single blocks split together, in model order

    # --- memory
    stage_params = rank_parameter_counts(a, tp, pp)
    base_stage_params = stage_params
    if adapters is not None:  # every weight stays, beside the adapters; only the adapters train
        stage_params = [b + a for b, a in zip(base_stage_params, adapters.per_stage, strict=True)]
    params = max(stage_params)
    # Constant buffers (SD3's sincos table) sit beside the weights in their dtype; nothing trains them.
    weights = max(p + b for p, b in zip(stage_params, rank_buffer_counts(a, pp), strict=True))
    trained = params if adapters is None else max(adapters.per_stage)
    shard = dp * cp if precision.distributed_optimizer else 1
    tokens_rank = s_img // cp + w.text_tokens
    mb_samples = w.micro_batch_size * cfg_x
    in_flight = min(pp, micro) if pp > 1 else 1

    def acts(mode: str) -> int:
        held = training_activation_bytes(a, tokens_per_rank=tokens_rank, micro_batch_samples=mb_samples, tp=tp,
                                         pp=pp, in_flight=in_flight, recompute=mode,
                                         act_bytes=precision.activation_bytes, image_tokens_per_rank=s_img // cp)
        if lora is not None:
            held += lora_activation_bytes(a, rank=lora.rank, targets=lora.targets,
                                          image_tokens_per_rank=s_img // cp, text_tokens=w.text_tokens,
                                          micro_batch_samples=mb_samples, pp=pp, in_flight=in_flight,
                                          recompute=mode, act_bytes=precision.activation_bytes)
        return held

    rollout_gpus = world_size if rollout.colocated else rollout.gpus
    rollout_weights = precision.rollout_param_bytes * (rollout_parameter_count(a, rollout.tp)
                                                       + rollout.extra_params)
    rollout_acts = rollout_activation_bytes(a, tokens=s_img + w.text_tokens, batch=rollout.batch * cfg_x,
                                            rollout_tp=rollout.tp, act_bytes=precision.activation_bytes)
    memory = MemoryReport(
        parameters=precision.param_bytes * weights,
        gradients=precision.grad_bytes * trained,
        optimizer_states=-(-precision.optimizer_bytes * trained // shard),
        activations=acts(recompute),
        activations_no_recompute=acts("none"),
        activations_full_recompute=acts("full"),
        rollout_weights=rollout_weights if rollout.colocated else 0,
        rollout_activations=rollout_acts if rollout.colocated else 0,
        reserve=reserve_bytes,
        capacity=gpu.memory_bytes,
        rollout_asleep=rollout.colocated and rollout.sleeps,
    )
    if not rollout.colocated:
        rollout_total = rollout_weights + rollout_acts + reserve_bytes
        if rollout_total > gpu.memory_bytes:
            warnings.append(f"rollout GPUs need {rollout_total / GIB:.1f} GiB of {gpu.memory_bytes / GIB:.1f}: "
                            f"raise rollout tp above {rollout.tp}")

    # --- time
    def bw(group: int, inner: int) -> float:
        """Collective bandwidth of a group whose members are `inner` ranks apart in the rank order."""
        fast = group * inner <= gpus_per_node
        return (gpu.link_bytes_per_s if fast else gpu.internode_bytes_per_s) * link_efficiency

    act_b = precision.activation_bytes
    # Per sample, per block forward on one rank: 2 all-reduces per stream of [tokens, h]; Ulysses: Q, K, V and
    # output all-to-alls of the image shard's heads, and an all-gather of the text output's heads.
    tp_fwd = 2 * (_allreduce_s(act_b * s_img // cp * hidden, tp, bw(tp, 1))
                  + _allreduce_s(act_b * w.text_tokens * hidden, tp, bw(tp, 1)))
    uly_bw = bw(lay.ulysses, tp)
    uly_fwd = (4 * _alltoall_s(act_b * s_img // cp * hidden / tp, lay.ulysses, uly_bw)
               + _alltoall_s(act_b * w.text_tokens * hidden / tp, lay.ulysses, uly_bw))
    # A second image attention (SD3.5-M's dual blocks) all-reduces its output projection once more.
    dual_blocks = sum(1 for i in a.image_attention_layers if i < blocks_per_stage)
    dual_comm = dual_blocks * _allreduce_s(act_b * s_img // cp * hidden, tp, bw(tp, 1))
    # FLUX's single block all-gathers [attention | MLP] (5 h / tp per token) before its output projection and that
    # projection's h / tp output after it, over [text; image]; under Ulysses its attention swaps as a double block's.
    single_fwd = _alltoall_s(act_b * (s_img // cp + w.text_tokens) * 6 * hidden, tp, bw(tp, 1)) + uly_fwd

    def stage_doubles(s: int) -> int:  # stages hold consecutive blocks in model order (FLUX: double, then single)
        return max(0, min((s + 1) * blocks_per_stage, a.layers) - s * blocks_per_stage)

    # Per sample, one stage's forward: the stage that communicates most.
    comm_fwd = max((tp_fwd + uly_fwd) * stage_doubles(s) + single_fwd * (blocks_per_stage - stage_doubles(s))
                   for s in range(pp)) + dual_comm
    fwd_passes_train = {"none": 1, "selective": 1, "full": 2}[recompute]  # forward comms in one training pass
    comm_train_sample = comm_fwd * (fwd_passes_train + 1)  # + the backward's mirror of the forward collectives

    peak = gpu.peak_bf16_flops
    fwd_rank = flops.per_rank(tp, cp, pp)
    ratio_rank = fwd_rank / flops.total  # this rank's share of one forward
    recompute_extra = {"none": 0.0, "selective": flops.selective_recompute, "full": flops.total}[recompute]
    train_rank = 3 * fwd_rank + recompute_extra * ratio_rank
    old_rank = fwd_rank  # one forward for the old log-probs
    if lora is not None:
        # See the module docstring: forward with the adapters; backward = the base's input gradients only (1x
        # its GEMMs' forward: no weight-gradient GEMMs), attention's 2x, the adapters' 2x; recompute runs the
        # forward (full) or the QKV projections and attention (selective) again, their adapters included.
        ad_whole = lora_forward_flops(a, s_img, w.text_tokens, lora.rank, lora.targets)
        ad_rank = lora_forward_flops(a, s_img, w.text_tokens, lora.rank, lora.targets, tp=tp).per_rank(tp, cp, pp)
        attn_rank = replace(flops, image_linear=0.0, text_linear=0.0, per_sample=0.0).per_rank(tp, cp, pp)
        extra_rank = {"none": 0.0, "selective": (flops.selective_recompute + ad_whole.qkv_linear) * ratio_rank,
                      "full": fwd_rank + ad_rank}[recompute]
        train_rank = (fwd_rank + ad_rank) + (fwd_rank + attn_rank + 2 * ad_rank) + extra_rank
        old_rank = fwd_rank + ad_rank
        extra_whole = {"none": 0.0, "selective": flops.selective_recompute + ad_whole.qkv_linear,
                       "full": flops.total + ad_whole.total}[recompute]
        # old log-probs + training of one (image, step) sample, all ranks together
        flops_train_sample = (int(w.recompute_old_logprob) * (flops.total + ad_whole.total)
                              + (flops.total + ad_whole.total) + (flops.total + flops.attention + 2 * ad_whole.total)
                              + extra_whole)
    bubble = (pp - 1) / micro
    samples_rank = w.images * w.window * cfg_x / dp  # (image, step) samples each replica trains per step
    train_compute = samples_rank * train_rank / (peak * mfu)
    train_comm = samples_rank * comm_train_sample
    # Distributed optimizer, once per mini-batch: reduce-scatter fp32 grads, all-gather bf16 params over dp*cp.
    opt_bw = bw(shard, tp) if shard > 1 else 1.0
    dp_comm = w.mini_batches * (_alltoall_s(precision.grad_bytes * trained, shard, opt_bw)
                                + _alltoall_s(precision.param_bytes * trained, shard, opt_bw))
    train_s = (train_compute + train_comm) * (1 + bubble) + dp_comm
    old_s = 0.0
    old_comm = 0.0
    if w.recompute_old_logprob:
        old_comm = samples_rank * comm_fwd
        old_s = (samples_rank * old_rank / (peak * mfu) + old_comm) * (1 + bubble)

    r_mfu = rollout.mfu if rollout.mfu is not None else mfu
    r_fwd = w.images * w.sampling_steps * cfg_x  # transformer forwards of one sample each, whole job
    encoder_flops = w.prompts * cfg_x * a.encoder_flops(w.text_tokens)
    replicas = rollout.replicas if rollout.replicas is not None else rollout_gpus // rollout.tp
    r_compute = (r_fwd * flops.total + encoder_flops) / (replicas * rollout.tp * peak * r_mfu)
    r_tp_fwd = 2 * cfg["num_layers"] * (_allreduce_s(act_b * s_img * hidden, rollout.tp, bw(rollout.tp, 1))
                                        + _allreduce_s(act_b * w.text_tokens * hidden, rollout.tp, bw(rollout.tp, 1)))
    r_comm = r_fwd / replicas * r_tp_fwd
    rollout_s = r_compute + r_comm

    # Weight sync: what one rollout GPU receives. Direct mode (same tp, no pp) copies the own shard locally.
    sync_bytes = precision.rollout_param_bytes * rollout_parameter_count(a, rollout.tp, buffers=False)
    direct = rollout.colocated and rollout.in_process and rollout.tp == tp and pp == 1
    sync_s = sync_bytes / (gpu.hbm_bytes_per_s if direct else bw(tp * pp, 1))
    step_s = rollout_s + old_s + train_s + sync_s
    total_gpus = world_size + (0 if rollout.colocated else rollout_gpus) + reward_gpus
    if lora is None:
        flops_per_image = (w.sampling_steps * cfg_x * flops.total
                           + w.window * cfg_x * (int(w.recompute_old_logprob) + 3) * flops.total
                           + w.window * cfg_x * recompute_extra)
    else:
        flops_per_image = w.sampling_steps * cfg_x * flops.total + w.window * cfg_x * flops_train_sample
    time = TimeReport(
        rollout_s=rollout_s,
        old_logprob_s=old_s,
        train_s=train_s,
        communication_s=r_comm + (train_comm + old_comm) * (1 + bubble) + dp_comm,
        bubble_fraction=bubble,
        step_s=step_s,
        images_per_s_per_gpu=w.images / (step_s * total_gpus),
        sync_s=sync_s,
    )
    return PlanReport(
        model=a.name, family=a.family, layout=lay, gpu=gpu, workload=w, rollout=rollout,
        recompute=recompute, mfu=mfu, gpus=total_gpus, image_tokens=s_img, micro_batches=micro, flops=flops,
        flops_per_image=flops_per_image, stage_parameters=stage_params, memory=memory, time=time,
        warnings=warnings, precision=precision,
        lora=None if adapters is None else LoRAReport(
            rank=lora.rank, alpha=lora.alpha, targets=tuple(lora.targets), modules=len(adapters.modules),
            total=adapters.total, stage_adapters=adapters.per_stage, stage_base=base_stage_params),
    )
