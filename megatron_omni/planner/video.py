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
FLOPs above at an assumed MFU, with the image planner's other terms (`planner.plan`):
- true CFG (`VideoWorkload.cfg`): every forward carries a negative row per clip (Wan guides plainly), in the
  rollout and in the trainer's recompute, so forwards and the micro-batch's rows double;
- the text encoder (umT5-XXL, `UMT5_XXL_PARAMS`): resident beside the engine's transformer and `2 params` FLOPs
  per text token, once per prompt (and once for the negative prompt);
- the VAE (Wan2.1's, or Wan2.2-TI2V's 48-channel one: `WAN_VAES`): resident, and its decode at the FLOPs per
  output pixel and frame measured with torch's FLOP counter on diffusers' module (meta device, 9 frames at
  64 x 64; it grows linearly with the frames and pixels), once per clip; an image-to-video clip also encodes its
  first frame (one frame: counted as one decode frame);
- collectives that do not overlap compute, at link bandwidth x efficiency as the image planner assumes them: per
  block forward three tp all-reduces of the video shard (self-attention, cross-attention, MLP outputs) and the
  Ulysses all-to-alls of q, k, v and the output; the backward mirrors the forward; the distributed optimizer's
  gradient reduce-scatter and parameter all-gather over dp x cp once per mini-batch. The rollout runs at tp 1
  (none).
`choose_cp` picks the smallest Ulysses degree whose plan fits: what a long clip needs, since its activations grow
with the tokens per rank.
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

# umT5-XXL's encoder (Wan's text encoder: d_model 4096, 24 layers, 64 heads, ffn 10240 gated, vocab 256384):
# transformers' UMT5EncoderModel on the meta device (tests/unit/test_wan_planner.py recounts it).
UMT5_XXL_PARAMS = 5_680_910_336


@dataclass(frozen=True)
class WanVAE:
    """A Wan VAE: its parameters (diffusers' AutoencoderKLWan on the meta device) and its decode's FLOPs per output
    pixel and frame (torch's FLOP counter, 9 frames at 64 x 64)."""

    name: str
    params: int
    decode_flops_per_pixel: float


# by the transformer's latent channels: Wan2.1's VAE (16, 4 x 8 x 8) and Wan2.2-TI2V's (48, 4 x 16 x 16: base 160,
# decoder 256, residual, 2 x 2 pixel patches)
WAN_VAES = {16: WanVAE("Wan2.1 VAE", 126_892_531, 8.70e6), 48: WanVAE("Wan2.2 VAE", 704_688_668, 1.89e7)}

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
    cfg: bool = False  # true CFG: a negative row beside every clip's in every forward

    @property
    def videos(self) -> int:
        return self.prompts * self.group_size


@dataclass(frozen=True)
class VideoPlan:
    """The plan of one layout: the resolved layout, the clip's patch grid and tokens, per-GPU memory, and the
    step's seconds by phase (compute at the assumed MFU; `communication_s` of them the collectives, `vae_s` and
    `text_encoder_s` of the rollout the VAE and the text encoder)."""

    layout: ParallelLayout
    grid: tuple[int, int, int]
    video_tokens: int
    memory: MemoryReport
    rollout_s: float
    old_logprob_s: float
    train_s: float
    gpu: GPUSpec
    mfu: float
    communication_s: float = 0.0
    vae_s: float = 0.0
    text_encoder_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.old_logprob_s + self.train_s

    def videos_per_s_per_gpu(self, videos: int) -> float:
        return videos / (self.step_s * self.layout.world_size)


def plan_video(model: str | dict[str, Any], layout: ParallelLayout, world_size: int, workload: VideoWorkload,
               gpu: str = "H200", precision: Precision | None = None, recompute: str = "none",
               mfu: float = DEFAULT_MFU, reserve_bytes: int = 4 * 1024**3, link_efficiency: float = 0.7,
               gpus_per_node: int = 8, rollout_experts: int = 1, vae_bytes: int | None = None) -> VideoPlan:
    """Per-GPU memory and step time of FlowGRPO on Wan at `layout` (see the module docstring); `rollout_experts`
    transformers of `model`'s shape are resident in the rollout engine (Wan2.2 A14B: 2, one running per step, one
    trained), which changes only the rollout's weights; `vae_bytes`: per parameter of the resident VAE
    (`rollout.vae_dtype`, e.g. flow_grpo's fp32 under a bf16 rollout; None: the rollout's dtype). Raises
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
    cfg_x = 2 if w.cfg else 1
    rows = w.micro_batch_size * cfg_x  # a forward's rows: the clips', then their negative rows under CFG

    def acts(mode: str) -> int:
        per_block = block_activation_bytes(hidden, tokens_rank, rows, tp, mode, precision.activation_bytes)
        held = cfg["num_layers"] // pp * in_flight * per_block
        if mode == "full":
            held += block_activation_bytes(hidden, tokens_rank, rows, tp, "none", precision.activation_bytes)
        return held

    shard = lay.dp * cp if precision.distributed_optimizer else 1
    if cfg["in_channels"] not in WAN_VAES:
        raise LayoutError(f"no Wan VAE of {cfg['in_channels']} latent channels (known: {sorted(WAN_VAES)})")
    vae = WAN_VAES[cfg["in_channels"]]
    # The embedded engine: the whole transformer per rank, one clip per forward (its widest block point, as
    # `memory.rollout_activation_bytes`: 3 h + 8 h per token at rollout tp 1).
    memory = MemoryReport(
        parameters=precision.param_bytes * params, gradients=precision.grad_bytes * params,
        optimizer_states=-(-precision.optimizer_bytes * params // shard), activations=acts(recompute),
        activations_no_recompute=acts("none"), activations_full_recompute=acts("full"),
        rollout_weights=precision.rollout_param_bytes * (rollout_experts * parameter_count(cfg) + UMT5_XXL_PARAMS)
        + (precision.rollout_param_bytes if vae_bytes is None else vae_bytes) * vae.params,
        rollout_activations=precision.activation_bytes * cfg_x * (tokens + w.text_tokens) * 11 * hidden,
        reserve=reserve_bytes, capacity=GPUS[gpu].memory_bytes)
    flops = wan_forward_flops(cfg, tokens, w.text_tokens)
    rate = GPUS[gpu].peak_bf16_flops * mfu
    rank_fwd = flops.per_rank(tp, cp, pp)
    recompute_extra = {"none": 0.0, "selective": flops.selective_recompute, "full": flops.total}[recompute]
    per_replica = w.videos * w.window * cfg_x / lay.dp  # forward rows of (clip, window step) each replica trains
    bubble = 1 + (pp - 1) / micro

    # collectives (the image planner's link model): per row and block forward on one rank
    def bw(group: int, inner: int) -> float:
        fast = group * inner <= gpus_per_node
        return (GPUS[gpu].link_bytes_per_s if fast else GPUS[gpu].internode_bytes_per_s) * link_efficiency

    act_b = precision.activation_bytes
    shard_bytes = act_b * tokens // cp * hidden
    comm_fwd = cfg["num_layers"] // pp * (3 * _allreduce_s(shard_bytes, tp, bw(tp, 1))
                                          + 4 * _alltoall_s(shard_bytes / tp, lay.ulysses, bw(lay.ulysses, tp)))
    trained = params
    dp_comm = w.mini_batches * (_alltoall_s(precision.grad_bytes * trained, shard, bw(shard, tp))
                                + _alltoall_s(precision.param_bytes * trained, shard, bw(shard, tp)))
    fwd_passes = {"none": 1, "selective": 1, "full": 2}[recompute]
    train_comm = per_replica * comm_fwd * (fwd_passes + 1)
    old_comm = per_replica * comm_fwd if w.recompute_old_logprob else 0.0
    train_s = (per_replica * (3 * rank_fwd + recompute_extra * rank_fwd / flops.total) / rate + train_comm) * bubble \
        + dp_comm
    old_s = (per_replica * rank_fwd / rate + old_comm) * bubble if w.recompute_old_logprob else 0.0
    # the rollout: every rank its share of the clips on the whole model (tp 1), the prompts' text encoding and
    # the VAE's decode (+ an image-to-video clip's one-frame encode, counted with it)
    text_s = (w.prompts + int(w.cfg)) * 2.0 * UMT5_XXL_PARAMS * w.text_tokens / world_size / rate
    vae_s = w.videos / world_size * vae.decode_flops_per_pixel * w.frames * w.height * w.width / rate
    rollout_s = w.videos / world_size * w.sampling_steps * cfg_x * flops.total / rate + text_s + vae_s
    return VideoPlan(layout=lay, grid=grid, video_tokens=tokens, memory=memory, rollout_s=rollout_s,
                     old_logprob_s=old_s, train_s=train_s, gpu=GPUS[gpu], mfu=mfu,
                     communication_s=(train_comm + old_comm) * bubble + dp_comm, vae_s=vae_s, text_encoder_s=text_s)


def _allreduce_s(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bw


def _alltoall_s(nbytes: float, n: int, bw: float) -> float:
    return 0.0 if n == 1 else (n - 1) / n * nbytes / bw


def choose_cp(model: str | dict[str, Any], world_size: int, workload: VideoWorkload, *, tp: int = 1, pp: int = 1,
              gpu: str = "H200", precision: Precision | None = None, recompute: str = "none",
              mfu: float = DEFAULT_MFU, max_cp: int = 8, rollout_experts: int = 1,
              vae_bytes: int | None = None) -> VideoPlan:
    """The plan at the smallest Ulysses degree (context parallelism over the video tokens, within `max_cp`: one
    node's GPUs) at which the job fits in the GPU's memory; layouts that cannot run are skipped. Raises
    LayoutError naming the largest tried when none fits."""
    tried = []
    for cp in range(1, max_cp + 1):
        try:
            got = plan_video(model, ParallelLayout(tp=tp, ulysses=cp, pp=pp), world_size, workload, gpu, precision,
                             recompute, mfu, rollout_experts=rollout_experts, vae_bytes=vae_bytes)
        except LayoutError as exc:
            tried.append(f"cp={cp}: {exc}")
            continue
        if got.memory.fits:
            return got
        tried.append(f"cp={cp}: {got.memory.total / 1024**3:.0f} GiB")
    raise LayoutError(f"no Ulysses degree up to {max_cp} fits this clip in {gpu} memory at tp={tp}, pp={pp} "
                      f"({'; '.join(tried)}); raise tp or pp, or use recompute")
