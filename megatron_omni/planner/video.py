"""The Wan video DiT's cost model for the dry-run planner: video tokens of a clip and the FLOPs of one forward,
split the way the planner splits the MMDiT's (`flops.ForwardFlops`), so context parallelism divides what scales
with the video tokens and replicates the rest.

A weight `[out, in]` applied to n tokens costs `2 out in n`; biases, norms, RoPE, activations and the
modulation are elementwise and left out. Per block: self-attention q/k/v and output projection, the
cross-attention's query and output projection, and the MLP act on the video tokens; the cross-attention's keys
and values on the text tokens; the softmax attention costs `4 s_v^2 h` (self) plus `4 s_v s_t h` (cross, its
queries the video's, so it divides over CP too). The patch embedding and `proj_out` act on the video tokens,
the text embedder on the text tokens, the timestep embedder and projection once per sample.

Parameter counts per rank are the provider's exact ones (`model_providers.wan.provider.per_rank_parameter_counts`).

`plan_video` is the dry run's plan of a FlowGRPO job on Wan (the trainer's path: the embedded diffusers engine
on every rank with the full transformer, rolling out its share of the clips, then the old log-probs and the
update on the Megatron model): per-GPU memory with the image planner's memory terms (`memory.MemoryReport`,
`memory.block_activation_bytes`, over the video tokens of this CP rank plus the text) and step time from the
FLOPs above at an assumed MFU. Collectives, the text encoder and the VAE are not modelled (a long clip's
attention dominates its forward). `choose_cp` picks the smallest Ulysses degree whose plan fits: what a long
clip needs, since its activations grow with the tokens per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.planner.flops import ForwardFlops
from megatron_omni.planner.memory import RECOMPUTE_MODES, MemoryReport, block_activation_bytes
from megatron_omni.planner.specs import DEFAULT_MFU, GPUS, GPUSpec, Precision
from model_providers.wan.provider import hf_config, megatron_shapes, parameter_count, per_rank_parameter_counts

# Wan2.1's VAE compresses 4x in time and 8x in space (Wan2.2-TI2V-5B's: 4 x 16 x 16).
VAE_TEMPORAL, VAE_SPATIAL = 4, 8

_VIDEO = ("patch_embedding.", "proj_out.")
_TEXT = ("text_embedder.",)
_SAMPLE = ("time_embedder.", "time_proj.")
_TEXT_IN_BLOCK = ("cross_attention.linear_k.", "cross_attention.linear_v.")
_QKV_IN_BLOCK = ("self_attention.linear_qkv.", "cross_attention.linear_q.", "cross_attention.linear_k.",
                 "cross_attention.linear_v.")


def vae_factors(model: str | dict[str, Any]) -> tuple[int, int]:
    """(temporal, spatial) compression of the VAE a Wan transformer is paired with: Wan2.2's 48-channel VAE
    compresses 4 x 16 x 16, Wan2.1's 16-channel one (and the tiny pipeline's) 4 x 8 x 8."""
    return (VAE_TEMPORAL, 16 if hf_config(model)["in_channels"] == 48 else VAE_SPATIAL)


def video_grid(model: str | dict[str, Any], frames: int, height: int, width: int, vae_temporal: int = VAE_TEMPORAL,
               vae_spatial: int = VAE_SPATIAL) -> tuple[int, int, int]:
    """The transformer's patch grid (f, h, w) of a `frames`-frame `height x width` clip: latent frames
    (frames - 1) / t + 1, then the 3D patches. Raises ValueError naming a size that does not divide."""
    pt, ph, pw = hf_config(model)["patch_size"]
    if frames < 1 or (frames - 1) % vae_temporal:
        raise ValueError(f"frames - 1 must be a multiple of the VAE's temporal factor {vae_temporal}, got {frames}")
    latent_f = (frames - 1) // vae_temporal + 1
    if latent_f % pt:
        raise ValueError(f"{latent_f} latent frames do not split into temporal patches of {pt}")
    for name, value, p in (("height", height, ph), ("width", width, pw)):
        if value < vae_spatial * p or value % (vae_spatial * p):
            raise ValueError(f"{name} {value} must be a positive multiple of {vae_spatial} * {p}")
    return latent_f // pt, height // (vae_spatial * ph), width // (vae_spatial * pw)


def wan_forward_flops(model: str | dict[str, Any], video_tokens: int, text_tokens: int) -> ForwardFlops:
    """FLOPs of one Wan forward of one sample (`image_linear` holds the video tokens' linears)."""
    if video_tokens < 1 or text_tokens < 1:
        raise ValueError(f"need video_tokens >= 1 and text_tokens >= 1, got {video_tokens}, {text_tokens}")
    cfg = hf_config(model)
    video = text = sample = qkv = 0.0
    for name, shape in megatron_shapes(cfg).items():
        if not name.endswith("weight") or len(shape) < 2:
            continue  # biases, norm scales and the modulation tables (not "weight"s): elementwise
        macs = math.prod(shape)
        tensor = name.split(".", 2)[2] if name.startswith("layers.") else name
        if name.startswith("layers."):
            on_text = tensor.startswith(_TEXT_IN_BLOCK)
            flops = 2 * macs * (text_tokens if on_text else video_tokens)
            if tensor.startswith(_QKV_IN_BLOCK):
                qkv += flops
            if on_text:
                text += flops
            else:
                video += flops
        elif name.startswith(_VIDEO):
            video += 2 * macs * video_tokens
        elif name.startswith(_TEXT):
            text += 2 * macs * text_tokens
        elif name.startswith(_SAMPLE):
            sample += 2 * macs
        else:
            raise ValueError(f"planner FLOPs model does not know where weight {name} {shape} applies")
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    attention = 4.0 * video_tokens * hidden * (video_tokens + text_tokens) * cfg["num_layers"]
    return ForwardFlops(image_linear=video, text_linear=text, per_sample=sample, attention=attention, qkv_linear=qkv)


@dataclass(frozen=True)
class VideoWorkload:
    """One RL step on video: `prompts x group_size` clips of `frames` frames at `height x width`, `text_tokens`
    per prompt (Wan pads to max_sequence_length), `sampling_steps` with an SDE `window`, `mini_batches` updates
    of micro-batches of `micro_batch_size` (clip, window step) transitions."""

    frames: int
    height: int
    width: int
    text_tokens: int
    sampling_steps: int
    window: int
    prompts: int
    group_size: int
    mini_batches: int
    micro_batch_size: int
    recompute_old_logprob: bool = True

    @property
    def videos(self) -> int:
        return self.prompts * self.group_size


@dataclass(frozen=True)
class VideoPlan:
    """The plan of one layout: the resolved layout, the clip's patch grid and tokens, per-GPU memory, and the
    step's seconds by phase (compute at the assumed MFU)."""

    layout: ParallelLayout
    grid: tuple[int, int, int]
    video_tokens: int
    memory: MemoryReport
    rollout_s: float
    old_logprob_s: float
    train_s: float
    gpu: GPUSpec
    mfu: float

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.old_logprob_s + self.train_s

    def videos_per_s_per_gpu(self, videos: int) -> float:
        return videos / (self.step_s * self.layout.world_size)


def plan_video(model: str | dict[str, Any], layout: ParallelLayout, world_size: int, workload: VideoWorkload,
               gpu: str = "H200", precision: Precision | None = None, recompute: str = "none",
               mfu: float = DEFAULT_MFU, reserve_bytes: int = 4 * 1024**3) -> VideoPlan:
    """Per-GPU memory and step time of FlowGRPO on Wan at `layout` (see the module docstring). Raises
    LayoutError naming what does not divide (heads, blocks, video tokens over cp, clips over dp) or an unknown
    GPU or recompute mode."""
    w, precision = workload, precision or Precision()
    if gpu not in GPUS:
        raise LayoutError(f"unknown GPU kind {gpu!r}; known: {sorted(GPUS)}")
    if recompute not in RECOMPUTE_MODES:
        raise LayoutError(f"unknown recompute mode {recompute!r}; known: {RECOMPUTE_MODES}")
    cfg = hf_config(model)
    try:
        grid = video_grid(cfg, w.frames, w.height, w.width, *vae_factors(cfg))
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    tokens = math.prod(grid)
    lay = layout.resolve(world_size)
    lay.validate_model(num_heads=cfg["num_attention_heads"], num_layers=cfg["num_layers"], image_tokens=tokens)
    per_mini = w.videos // w.mini_batches
    if w.videos % w.mini_batches or per_mini % lay.dp:
        raise LayoutError(f"{w.videos} clips per step in {w.mini_batches} mini-batches do not divide over "
                          f"dp={lay.dp}")
    transitions = per_mini // lay.dp * w.window
    if transitions % w.micro_batch_size:
        raise LayoutError(f"{transitions} transitions per mini-batch per replica are not divisible by micro-batch "
                          f"size {w.micro_batch_size}")
    tp, cp, pp = lay.tp, lay.cp, lay.pp
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    params = max(per_rank_parameter_counts(cfg, tp, pp))
    micro = transitions // w.micro_batch_size
    in_flight = min(pp, micro) if pp > 1 else 1
    tokens_rank = tokens // cp + w.text_tokens

    def acts(mode: str) -> int:
        per_block = block_activation_bytes(hidden, tokens_rank, w.micro_batch_size, tp, mode,
                                           precision.activation_bytes)
        held = cfg["num_layers"] // pp * in_flight * per_block
        if mode == "full":
            held += block_activation_bytes(hidden, tokens_rank, w.micro_batch_size, tp, "none",
                                           precision.activation_bytes)
        return held

    shard = lay.dp * cp if precision.distributed_optimizer else 1
    # The embedded engine: the whole transformer per rank, one clip per forward (its widest block point, as
    # `memory.rollout_activation_bytes`: 3 h + 8 h per token at rollout tp 1).
    memory = MemoryReport(
        parameters=precision.param_bytes * params, gradients=precision.grad_bytes * params,
        optimizer_states=-(-precision.optimizer_bytes * params // shard), activations=acts(recompute),
        activations_no_recompute=acts("none"), activations_full_recompute=acts("full"),
        rollout_weights=precision.rollout_param_bytes * parameter_count(cfg),
        rollout_activations=precision.activation_bytes * (tokens + w.text_tokens) * 11 * hidden,
        reserve=reserve_bytes, capacity=GPUS[gpu].memory_bytes)
    flops = wan_forward_flops(cfg, tokens, w.text_tokens)
    rate = GPUS[gpu].peak_bf16_flops * mfu
    rank_fwd = flops.per_rank(tp, cp, pp)
    recompute_extra = {"none": 0.0, "selective": flops.selective_recompute, "full": flops.total}[recompute]
    per_replica = w.videos * w.window / lay.dp  # (clip, window step) transitions each replica trains
    bubble = 1 + (pp - 1) / micro
    train_s = per_replica * (3 * rank_fwd + recompute_extra * rank_fwd / flops.total) / rate * bubble
    old_s = per_replica * rank_fwd / rate * bubble if w.recompute_old_logprob else 0.0
    rollout_s = w.videos / world_size * w.sampling_steps * flops.total / rate  # every rank its share, whole model
    return VideoPlan(layout=lay, grid=grid, video_tokens=tokens, memory=memory, rollout_s=rollout_s,
                     old_logprob_s=old_s, train_s=train_s, gpu=GPUS[gpu], mfu=mfu)


def choose_cp(model: str | dict[str, Any], world_size: int, workload: VideoWorkload, *, tp: int = 1, pp: int = 1,
              gpu: str = "H200", precision: Precision | None = None, recompute: str = "none",
              mfu: float = DEFAULT_MFU, max_cp: int = 8) -> VideoPlan:
    """The plan at the smallest Ulysses degree (context parallelism over the video tokens, within `max_cp`: one
    node's GPUs) at which the job fits in the GPU's memory; layouts that cannot run are skipped. Raises
    LayoutError naming the largest tried when none fits."""
    tried = []
    for cp in range(1, max_cp + 1):
        try:
            got = plan_video(model, ParallelLayout(tp=tp, ulysses=cp, pp=pp), world_size, workload, gpu, precision,
                             recompute, mfu)
        except LayoutError as exc:
            tried.append(f"cp={cp}: {exc}")
            continue
        if got.memory.fits:
            return got
        tried.append(f"cp={cp}: {got.memory.total / 1024**3:.0f} GiB")
    raise LayoutError(f"no Ulysses degree up to {max_cp} fits this clip in {gpu} memory at tp={tp}, pp={pp} "
                      f"({'; '.join(tried)}); raise tp or pp, or use recompute")
