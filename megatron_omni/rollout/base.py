"""What every rollout engine promises: the `RolloutEngine` protocol, its sampling settings and the
`Trajectory` record the trainer consumes.

A trajectory holds, for N samples (G per prompt) and the W window steps of each, everything needed to
recompute the log-probs with another model: the prompt embeddings and masks (and the negative ones for
true CFG), the window latents x_t and x_{t+1}, the rollout log-probs, each sample's sigma grid and window
start, the per-sample seeds and the decoded images.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, runtime_checkable

import torch

from megatron_omni.algorithms.sde import SDE_TYPES
from megatron_omni.algorithms.window import check_window
from megatron_omni.bridge.targets import RolloutTarget


@dataclass(frozen=True)
class SdeWindowParams:
    """The SDE window every sampler shares (one set of defaults for every engine): `num_steps` grid steps,
    of which `window_size` consecutive ones, starting inside `window_range` ([lo, hi); default
    [0, max(window_size, num_steps // 2))), are SDE steps (`sde_type`, `noise_level`) and the rest ODE."""

    num_steps: int = 10
    noise_level: float = 1.2
    sde_type: str = "sde"
    window_size: int = 2
    window_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"unknown sde_type {self.sde_type!r}; expected one of {SDE_TYPES}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")
        if self.stochastic:
            check_window(self.num_steps, self.window_size, self.resolved_window_range)

    @property
    def stochastic(self) -> bool:
        """True when the rollout records SDE transitions (a window with noise)."""
        return self.noise_level > 0 and self.window_size > 0

    @property
    def resolved_window_range(self) -> tuple[int, int]:
        """[lo, hi) of the window's first step (every range a valid window fits in keeps its old bounds)."""
        if self.window_range is not None:
            return self.window_range
        return (0, max(1, self.window_size, self.num_steps // 2))

    @classmethod
    def from_config(cls, config: Any, **overrides: Any):
        """This record from any object (a config section) with attributes of the same names: the fields it
        has are taken (lists as tuples), the others keep their defaults; `overrides` win."""
        values = {}
        for f in fields(cls):
            if hasattr(config, f.name):
                v = getattr(config, f.name)
                values[f.name] = tuple(v) if isinstance(v, list) else v
        return cls(**{**values, **overrides})


@dataclass(frozen=True)
class SamplingParams(SdeWindowParams):
    """How to sample one group (the SDE window's fields from `SdeWindowParams`). `window_start=None` draws it
    per sample from the sample's seed; `noise_level=0` (or window_size 0) samples the pure ODE and records no
    transitions."""

    height: int = 64
    width: int = 64
    # Frames of a video (what the VAE decodes; a video engine's latent frames follow from it); 1 for images.
    num_frames: int = 1
    window_start: int | None = None
    guidance_scale: float = 1.0
    negative_prompt: str | None = None
    max_sequence_length: int = 512
    # Every forward pads the text (and the negative prompt's) to this many tokens; None: the longest text of
    # the `generate` call. Calls that must pad alike (the shares of one trainer step rolled out on several
    # ranks) set it: a bf16 attention over another text length rounds differently.
    text_length: int | None = None
    # MixGRPO-Flash: the ODE steps after the window are re-spaced into this many steps sampled with the multistep
    # DPM-Solver++ (`algorithms.mixgrpo`); None: the grid's own steps, Euler. Needs a fixed `window_start`.
    tail_steps: int | None = None
    # The guidance scale a guidance-distilled model takes as an input (FLUX.1-dev's `guidance`, not true CFG); None:
    # the engine's default for a model that takes one (FLUX: FluxPipeline's 3.5), none for a model that does not.
    distilled_guidance: float | None = None
    # Wan2.2 A14B: the true-CFG scale of the low-noise expert's steps (`WanPipeline`'s `guidance_scale_2`;
    # `guidance_scale` guides the high-noise expert's); None: `guidance_scale` on every step. Needs CFG on.
    guidance_scale_2: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.height <= 0 or self.width <= 0:
            raise ValueError(f"height/width must be positive, got {self.height}x{self.width}")
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        if self.guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 = no CFG), got {self.guidance_scale}")
        if self.guidance_scale > 1 and self.negative_prompt is None:
            raise ValueError("guidance_scale > 1 (true CFG) needs a negative_prompt (may be ' ')")
        if self.guidance_scale_2 is not None and not (self.guidance_scale > 1 and self.guidance_scale_2 >= 1):
            raise ValueError(f"guidance_scale_2={self.guidance_scale_2} needs true CFG on (guidance_scale > 1, got "
                             f"{self.guidance_scale}: WanPipeline guides only then) and must be >= 1")
        if self.distilled_guidance is not None and not self.distilled_guidance > 0:
            raise ValueError(f"distilled_guidance must be positive, got {self.distilled_guidance}")
        if not 1 <= self.max_sequence_length <= 1024:
            raise ValueError(f"max_sequence_length must be in [1, 1024], got {self.max_sequence_length}")
        if self.text_length is not None and not 1 <= self.text_length <= self.max_sequence_length:
            raise ValueError(f"text_length must be in [1, max_sequence_length={self.max_sequence_length}], got "
                             f"{self.text_length}")
        if self.stochastic and self.window_start is not None:
            lo, hi = self.resolved_window_range
            if not lo <= self.window_start <= hi - self.window_size:
                raise ValueError(f"window_start {self.window_start} outside window_range {(lo, hi)}")
        if self.tail_steps is not None:
            if self.tail_steps < 1:
                raise ValueError(f"tail_steps must be >= 1, got {self.tail_steps}")
            if not self.stochastic or self.window_start is None:
                raise ValueError("tail_steps (MixGRPO-Flash) needs a stochastic window with a fixed window_start")
            if self.window_start + self.window_size >= self.num_steps:
                raise ValueError(f"tail_steps: the window [{self.window_start}, {self.window_start + self.window_size})"
                                 f" leaves no steps after it in a grid of {self.num_steps}")

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1

    def ode(self) -> SamplingParams:
        """The same settings without noise (validation sampling): the whole grid, Euler."""
        return replace(self, noise_level=0.0, window_start=None, tail_steps=None)


@dataclass
class Trajectory:
    """N samples' rollout record (W = window steps, S = image tokens, C = packed latent channels,
    L = text tokens, D = text width, T = sampling steps).

    prompts: N prompts; group_ids [N] long (samples of one prompt share an id); seeds [N] long;
    prompt_embeds [N, L, D] fp32 + prompt_embeds_mask [N, L] long; negative_* likewise or None;
    guidance_scale [N] fp32; latents / next_latents [N, W, S, C] fp32 (x_t and x_{t+1} of each window
    step); log_probs [N, W] fp32; sigmas [N, T + 1] fp32 (each sample's grid as sampled: MixGRPO-Flash's is
    shorter); window_start [N] long; images [N, 3, H, W] fp32 in [0, 1]; img_shape (1, H / 16, W / 16) the
    transformer's patch grid; final_latents [N, S, C] fp32, the clean latents the sampler ended with (what
    DiffusionNFT trains on; None from an engine that does not record them); policy_version [N] long, the
    version of the weights that sampled each sample (trainer updates applied before them; set by the
    asynchronous rollout service, `rollout.async_service`; None from a synchronous rollout).
    pooled_embeds / negative_pooled_embeds [N, P] fp32: the pooled text embeddings the rollout conditioned on, for a
    family that takes them (SD3.5's pooled CLIP embeddings; None otherwise), so a recompute sees what the rollout
    saw; cfg_rescale: how true CFG combined the velocities (True: Qwen-Image's per-token rescale; False: plain
    guidance, SD3.5's); distilled_guidance [N] fp32: the guidance scale a guidance-distilled model took as an input
    (FLUX.1-dev's; None for a model that takes none).

    Video (the Wan engine): S = f * h * w tokens of 3D patches (frames first, then rows and columns) and
    C = c * pt * ph * pw (`models.dit.embeddings.patchify_video`); img_shape = (f, h, w), the patch grid of the
    latent video (f = (F - 1) / 4 + 1 latent frames for F frames, h = H / 16, w = W / 16 with Wan's VAE and
    patch); images [N, F, 3, H, W], each sample's frames. The text is zero-padded to the pipeline's
    `max_sequence_length` (SamplingParams.text_length when set) and Wan attends to all of it: the mask marks
    the prompt's own tokens but the model does not read it, so trajectories to be concatenated must share L.

    Editing (a family with `DiTTraits.conditioned`): cond_latents [N, S_c, C] fp32, the packed VAE latents of
    each sample's source images exactly as the rollout fed them after its latents in the image stream (the
    recompute appends the same tensors), on patch grids cond_shapes ((1, h_1, w_1), ...), shared by the
    trajectory; None and () without sources.

    Image-to-video (Wan2.2 TI2V, `expand_timesteps`): clean_tokens, the leading image tokens that are the clean
    condition (the first latent frame's tokens: the VAE latents of the image, f = 1 of the grid); they sit at
    timestep 0 in every forward, every step leaves them as they are (latents, next_latents and final_latents hold
    the condition there) and they carry no log-prob; 0 without.
    """

    prompts: list[str]
    group_ids: torch.Tensor
    seeds: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    negative_prompt_embeds_mask: torch.Tensor | None
    guidance_scale: torch.Tensor
    latents: torch.Tensor
    next_latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    window_start: torch.Tensor
    images: torch.Tensor
    img_shape: tuple[int, int, int]
    noise_level: float
    sde_type: str
    final_latents: torch.Tensor | None = None
    policy_version: torch.Tensor | None = None
    cond_latents: torch.Tensor | None = None
    cond_shapes: tuple[tuple[int, int, int], ...] = ()
    pooled_embeds: torch.Tensor | None = None
    negative_pooled_embeds: torch.Tensor | None = None
    cfg_rescale: bool = True
    distilled_guidance: torch.Tensor | None = None
    clean_tokens: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def window_size(self) -> int:
        return self.log_probs.shape[1]

    @property
    def step_indices(self) -> torch.Tensor:
        """[N, W] long: the sampling-step index of each recorded transition."""
        return self.window_start.unsqueeze(1) + torch.arange(self.window_size, dtype=torch.long)

    def select(self, index: torch.Tensor | Sequence[int]) -> Trajectory:
        """The samples at `index` (a mini-batch), as a new Trajectory."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "prompts":
                out[f.name] = [value[i] for i in idx.tolist()]
            elif isinstance(value, torch.Tensor):
                out[f.name] = value[idx]
            else:
                out[f.name] = value
        return Trajectory(**out)

    @staticmethod
    def concat(parts: Sequence[Trajectory]) -> Trajectory:
        """The samples of `parts` in order, as one Trajectory. Text is right-padded (embeddings 0, mask 0)
        to the longest part's L, which the masked joint attention ignores."""
        if not parts:
            raise ValueError("no trajectories to concatenate")
        first = parts[0]
        for p in parts[1:]:
            if ((p.img_shape, p.noise_level, p.sde_type, p.cfg_rescale, p.clean_tokens)
                    != (first.img_shape, first.noise_level, first.sde_type, first.cfg_rescale, first.clean_tokens)):
                raise ValueError("trajectories of different image shapes, SDE, CFG settings or image conditions "
                                 "(clean_tokens) cannot be concatenated")
            if tuple(p.cond_shapes) != tuple(first.cond_shapes):
                raise ValueError("trajectories of different source-image grids cannot be concatenated")
        out: dict[str, Any] = {}
        for f in fields(first):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "prompts":
                out[f.name] = [x for v in values for x in v]
            elif any(v is None for v in values):
                if not all(v is None for v in values):
                    raise ValueError(f"{f.name} is set in some trajectories and not in others")
                out[f.name] = None
            elif f.name.endswith("prompt_embeds") or f.name.endswith("prompt_embeds_mask"):
                length = max(v.shape[1] for v in values)
                out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, length - v.shape[1]))
                                         for v in values])
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values)
            else:
                out[f.name] = values[0]
        return Trajectory(**out)


@dataclass
class FinishedSample:
    """One sample as soon as it is done (streamed to the reward client): index into the call's
    output, its prompt, group id, seed and image [3, H, W] fp32 in [0, 1] (a video: its frames [F, 3, H, W])."""

    index: int
    prompt: str
    group_id: int
    seed: int
    image: torch.Tensor


def sample_seeds(num_prompts: int, group_size: int, seeds: Sequence[int] | None) -> list[int]:
    """The per-sample seeds of a `generate` call (default: the row numbers 0..N-1), checked against its
    N = num_prompts * group_size samples."""
    if num_prompts < 1:
        raise ValueError("no prompts")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    n = num_prompts * group_size
    out = list(range(n)) if seeds is None else [int(s) for s in seeds]
    if len(out) != n:
        raise ValueError(f"{len(out)} seeds for {n} samples")
    return out


@dataclass(frozen=True)
class WeightSink:
    """Where the bridge writes an engine's transformer weights on this rank.

    kind: the sync plan's rollout layout ("diffusers" | "vllm_omni"); tp: the engine's tensor-parallel size;
    target: the bridge target on this rank (None on a rank that holds no part of the engine); in_place: the
    target's parameters are the engine's live tensors in this process, so the bridge may copy trainer shards
    straight into them (`direct` mode) instead of handing full tensors to the engine's loader (`full`).
    """

    kind: str
    tp: int
    target: RolloutTarget | None
    in_place: bool


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator of FlowGRPO trajectories that can receive fresh weights.

    The trainer builds it through `megatron_omni.rollout.registry.build_engine` (by `rollout.engine` name),
    takes the model's architecture and initial weights from it, syncs trained weights into its `weight_sink`
    inside `weight_update()`, proves the sync with `probe`, and puts it to sleep while it trains.
    """

    dtype: torch.dtype  # what the transformer computes in (the SDE math is fp32 regardless)
    # generate() is collective over the ranks that share the engine: each of them calls it with its own share
    # (possibly empty: then it returns None) and the engine runs their union.
    collective: bool

    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        group_size: int = 1,
        seeds: Sequence[int] | None = None,
        on_sample: Callable[[FinishedSample], None] | None = None,
    ) -> Trajectory:
        """`group_size` samples per prompt (sample k of prompt p at index p * group_size + k) with the
        given per-sample seeds (default 0..N-1); `on_sample` is called as each sample finishes. A `collective`
        engine may be called with no prompts (serving its peers' shares): it then returns None."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy diffusers-named transformer tensors into the engine; returns the names loaded and raises
        on an unknown name or a shape mismatch."""
        ...

    def text_lengths(self, prompts: Sequence[str]) -> list[int]:
        """Text tokens each prompt gives the transformer (before padding); the trainer pads every share of a
        step to one length with them (`SamplingParams.text_length`), since the padding length moves bf16
        attention's rounding."""
        ...

    def transformer_config(self) -> dict[str, Any]:
        """The diffusers config of the engine's transformer (what `model_providers.qwen_image` builds from)."""
        ...

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The transformer weights the engine started from, full diffusers-named tensors in its dtype."""
        ...

    def weight_sink(self) -> WeightSink:
        """Where the bridge writes this rank's part of the engine's transformer."""
        ...

    def weight_update(self) -> AbstractContextManager[None]:
        """Brackets one complete sync into `weight_sink()` (an engine may check completeness on exit)."""
        ...

    def probe(self, traj: Trajectory) -> torch.Tensor:
        """Transition means [N, W, S, C] fp32 of the fixed trajectory `traj` under the engine's transformer as it
        holds its weights now (the proof that a sync reached the weights it samples with). Collective over
        the ranks that share the engine."""
        ...

    def probe_unquantized(self, traj: Trajectory) -> torch.Tensor | None:
        """`probe` with the engine's quantization off: the same weights without their FP8 rounding (an
        unquantized engine: its `probe`); None for an engine that holds only quantized weights. Collective like
        `probe`; `rollout.probe.check_quantized_probe` reads both."""
        ...

    def sleep(self) -> None:
        """Release device memory between rollouts where the engine can; generate() refuses until wake_up()."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep`."""
        ...

    def close(self) -> None:
        """Release the engine (its workers, its parallel state)."""
        ...
