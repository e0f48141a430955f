"""Our FlowGRPO SDE pipeline inside vLLM-Omni: its Qwen-Image pipeline class, denoised by OUR stepping code.

`FlowGRPOQwenImagePipeline` subclasses vLLM-Omni 0.30.0's `QwenImagePipeline` (same components: its
tensor-parallel `QwenImageTransformer2DModel`, the Qwen2.5-VL text encoder, the VAE, the tokenizer) and
replaces the denoising loop with `DiffusersRolloutEngine`'s: the same per-sample generators (initial noise,
window start, SDE noise drawn in the same order), the same guided velocity and `algorithms.sde` step and
log-prob, the same decode. So for the same seeds and weights it produces the same trajectory as the
embedded engine, and the trainer's `recompute_log_probs` agrees with it as it does with the embedded one.

Registered with vLLM-Omni through `custom_pipeline_args={"pipeline_class": PIPELINE_CLASS}`. One vLLM-Omni
request is one sample: the call's `OmniDiffusionSamplingParams.extra_args[EXTRA_KEY]` carries our
`SamplingParams` (as a dict; vLLM-Omni takes one sampling-params object per stage, not per request), each
prompt's `additional_information[EXTRA_KEY]` the sample's seed, row index and group id; each request's
`DiffusionOutput` carries the image
(in [-1, 1], what vLLM-Omni's Qwen-Image post-processing expects) and, in `trajectory_latents`, the
sample's trajectory record as a dict of tensors (`record_to_trajectory` stacks them back).

vLLM-Omni is imported lazily: the class is built on first attribute access (module `__getattr__`), so
importing this module needs neither vllm nor vllm_omni.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from megatron_omni.algorithms.schedule import ShiftConfig
from megatron_omni.algorithms.velocity import pad_text
from megatron_omni.parallel import platform
from megatron_omni.rollout.base import SamplingParams, Trajectory
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample, vae_in_dtype
from megatron_omni.rollout.vllm_omni import fp8

PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.pipeline.FlowGRPOQwenImagePipeline"
EXTRA_KEY = "flowgrpo"
# vLLM-Omni's start-up warm-up request asks for 512 x 512 (`DiffusionEngine._dummy_run`): on a GPU that primes the
# kernels and the allocator for large shapes. A CPU has neither to prime, so there the warm-up runs the same path
# (text encoder, transformer, scheduler, VAE decode) at this side: 0.4 s of a tiny model's start instead of 8-12 s
# (measured at 2 threads, per worker process: every start of the engine paid it).
CPU_WARM_UP_SIDE = 64
# Per-sample tensors of a record; the rest of a Trajectory is per call (params, img_shape).
RECORD_TENSORS = ("prompt_embeds", "negative_prompt_embeds", "latents", "next_latents", "log_probs", "sigmas",
                  "image", "final_latents")


class VllmOmniVelocity:
    """vLLM-Omni's transformer behind the diffusers forward keywords that `GuidedBatch.velocity` uses.

    vLLM-Omni's copy also takes `txt_seq_lens`: the padded text width per row (diffusers derives the text
    RoPE table from `encoder_hidden_states.shape[1]`, so the padded width keeps both identical).
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer

    def __call__(self, *, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 encoder_hidden_states_mask: torch.Tensor, timestep: torch.Tensor, img_shapes: list,
                 return_dict: bool = False) -> tuple[torch.Tensor]:
        """Velocity [B, S, C] for latents [B, S, C], text [B, L, D] + mask [B, L], timestep [B] (= sigma)."""
        out = self.transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            timestep=timestep,
            img_shapes=img_shapes,
            txt_seq_lens=[int(encoder_hidden_states.shape[1])] * hidden_states.shape[0],
            return_dict=False,
        )
        return (out[0] if isinstance(out, tuple | list) else out.sample,)


class SdeStepper(DiffusersRolloutEngine):
    """The embedded engine's step-wise continuous batching loop over a vLLM-Omni pipeline's components.

    Only the construction differs from `DiffusersRolloutEngine` (nothing is loaded: the components are the
    vLLM-Omni pipeline's, already on its device) and `load_weights`, which goes through vLLM-Omni's
    loader (fused q/k/v, tensor-parallel slices) and raises on anything it did not load. What is Qwen-Image's here
    (the transformer config the loop reads, the sigma grid's settings, the velocity interface, the full shapes, the
    loader's renames) is in hooks another family's stepper overrides (`vllm_omni.wan_pipeline.WanSdeStepper`).
    """

    # vLLM-Omni loader renames: diffusers name -> the parameter its `load_weights` reports loaded instead
    weight_renames: Mapping[str, str] = {}

    def __init__(self, pipeline: Any, max_batch_size: int = 8, embed_cache_size: int = 4096) -> None:  # noqa: D107
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        transformer = pipeline.transformer
        self.device = torch.device(pipeline.device)
        self.dtype = next(transformer.parameters()).dtype
        self.pipe = pipeline
        # The loop reads only a few config fields from the transformer; vLLM-Omni's module has no diffusers config.
        self.transformer = SimpleNamespace(config=SimpleNamespace(**self._config_view(pipeline)))
        self.shift = self._pipeline_shift(pipeline)
        self.velocity_model = self._velocity(pipeline)
        self.max_batch_size = max_batch_size
        self.embed_cache_size = embed_cache_size
        self.progress = False
        self._cache = OrderedDict()
        self._asleep = False
        self.stats = {"forwards": 0, "forward_rows": 0, "cache_hits": 0, "cache_misses": 0}

        self.full_shapes = self._full_shapes(pipeline)

    def _config_view(self, pipeline: Any) -> dict[str, Any]:
        return {"in_channels": pipeline.transformer.in_channels}

    def _pipeline_shift(self, pipeline: Any) -> Any:
        return ShiftConfig.from_scheduler_config(pipeline.scheduler.config)

    def _velocity(self, pipeline: Any) -> Any:
        return VllmOmniVelocity(pipeline.transformer)

    def _full_shapes(self, pipeline: Any) -> dict[str, tuple[int, ...]]:
        return diffusers_shapes(pipeline.od_config.tf_model_config.to_dict())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Diffusers-named transformer tensors (with or without `transformer.`) into vLLM-Omni's module;
        see `load_transformer_weights` (an FP8 engine's in one layer-wise reload)."""
        reloader = getattr(self.pipe, "fp8_reloader", None)
        if reloader is None:
            return load_transformer_weights(self.pipe.transformer, named_tensors, self.full_shapes,
                                            renames=self.weight_renames)
        reloader.begin()
        try:
            return load_transformer_weights(self.pipe.transformer, named_tensors, self.full_shapes, reloader)
        finally:
            reloader.finish()


def diffusers_shapes(config: Mapping[str, Any],
                     model_class: str = "QwenImageTransformer2DModel") -> dict[str, tuple[int, ...]]:
    """Diffusers name -> full shape of every tensor of a diffusers transformer `model_class` (Qwen-Image's by
    default) with this diffusers config (built on the meta device: no memory, no weights)."""
    import diffusers

    cfg = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    with torch.device("meta"):
        module = getattr(diffusers, model_class).from_config(cfg)
    return {n: tuple(t.shape) for n, t in module.state_dict().items()}


def check_full_weights(named_tensors: Iterable[tuple[str, torch.Tensor]],
                       full_shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """Full diffusers-named tensors (prefix `transformer.` optional) checked against `full_shapes`: an unknown
    name raises KeyError, a wrong shape ValueError, none at all ValueError. Returns them without the prefix."""
    items = [(n.removeprefix("transformer."), t) for n, t in named_tensors]
    if not items:
        raise ValueError("no weights to load")
    for name, t in items:
        if name not in full_shapes:
            raise KeyError(f"unknown transformer weight {name!r} (not a parameter of the engine's diffusers "
                           "transformer)")
        if tuple(t.shape) != tuple(full_shapes[name]):
            raise ValueError(f"{name}: shape {tuple(t.shape)} != the model's full shape {tuple(full_shapes[name])}")
    return items


def load_transformer_weights(transformer: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]],
                             full_shapes: Mapping[str, tuple[int, ...]], reloader: Any = None,
                             renames: Mapping[str, str] | None = None) -> list[str]:
    """Load full diffusers-named tensors (prefix `transformer.` optional) through vLLM-Omni's
    `load_weights`, which fuses q/k/v and takes this tp rank's slice; through `reloader` (an FP8 engine's
    `fp8.Fp8WeightReloader`, inside one of its updates) when given.

    vLLM-Omni skips unknown names silently and its tp loaders narrow an oversized tensor without
    complaint, so every name and full shape is checked against `full_shapes` first: an unknown name raises
    KeyError, a wrong shape ValueError, a tensor the loader did not take RuntimeError (one it reports loaded under
    its new name, `renames[name]`, was taken). Returns the names.
    """
    from megatron_omni.bridge.targets import VllmOmniTarget

    items = check_full_weights(named_tensors, full_shapes)
    loaded = (VllmOmniTarget(transformer, 0, 1).load_full(items) if reloader is None else reloader.load(items))
    renames = renames or {}
    missed = [n for n, _ in items if n not in loaded and renames.get(n) not in loaded]
    if missed:
        raise RuntimeError(f"vLLM-Omni's loader skipped {len(missed)} tensors, e.g. {missed[:3]}")
    return [n for n, _ in items]


# ---------------------------------------------------------------------------------------------- requests


def warm_up_side(asked: Any, multiple: int) -> int:
    """The side (pixels) a pipeline answers vLLM-Omni's warm-up request at: the `asked` side (None: 64), at most
    `CPU_WARM_UP_SIDE` where no GPU is, rounded down to a multiple of `multiple` (VAE factor x patch), at least one."""
    side = int(asked or CPU_WARM_UP_SIDE)
    if not platform.has_gpu():
        side = min(side, CPU_WARM_UP_SIDE)
    return max(multiple, side // multiple * multiple)


def single_stage_devices(tp: int) -> dict[str, dict[str, str]]:
    """The `stage_overrides` that give a bundled one-stage deploy config pinned to `devices: "0"` (vLLM-Omni's
    Wan2.2 and BAGEL ones) devices 0..tp-1 of the engine's owner (numbered from 0); without it, rollout tp > 1 is
    refused at stage set-up ("requires 2 device(s) ... 1 device(s) are available")."""
    return {"0": {"devices": ",".join(str(i) for i in range(tp))}}


def sampling_extra(params: SamplingParams) -> dict[str, Any]:
    """What the call's `OmniDiffusionSamplingParams.extra_args[EXTRA_KEY]` carries (plain Python values)."""
    return {"params": dataclasses.asdict(params)}


def sample_prompt(prompt: str, seed: int, index: int, group_id: int) -> dict[str, Any]:
    """One sample's vLLM-Omni prompt: the text plus its seed, row index and group id."""
    return {"prompt": prompt, "additional_information": {EXTRA_KEY: {"seed": int(seed), "index": int(index),
                                                                    "group_id": int(group_id)}}}


def request_params(sampling: Any, key: str, field: str, tuples: Sequence[str], who: str, see: str) -> dict[str, Any]:
    """The call's parameters a request carries, `sampling.extra_args[key][field]`, as a dict whose `tuples` entries
    (JSON lists on the way) are tuples again; raises naming what is missing (`who`: the pipeline, `see`: the function
    that builds them). Shared by our pipeline classes' request parsers."""
    extra = (getattr(sampling, "extra_args", None) or {}).get(key)
    if not isinstance(extra, Mapping) or field not in extra:
        raise ValueError(f"{who}: sampling_params.extra_args[{key!r}] with {field!r} is required (see {see})")
    raw = dict(extra[field])
    for name in tuples:
        if raw.get(name) is not None:
            raw[name] = tuple(raw[name])
    return raw


def request_sample(prompt: Any, key: str, fields: Iterable[str], who: str, see: str) -> Mapping[str, Any]:
    """One request's own values, `prompt["additional_information"][key]`, holding every one of `fields`; raises
    naming those it lacks (`who`, `see` as in `request_params`)."""
    sample = ((prompt.get("additional_information") if isinstance(prompt, Mapping) else None) or {}).get(key) or {}
    missing = set(fields) - set(sample)
    if missing:
        raise ValueError(f"{who}: prompt additional_information[{key!r}] lacks {sorted(missing)} (see {see})")
    return sample


def parse_request(prompt: Any, sampling: Any) -> tuple[str, SamplingParams, int, int, int]:
    """(text, SamplingParams, seed, index, group_id) of one request; raises naming what is missing."""
    raw = request_params(sampling, EXTRA_KEY, "params", ("window_range",), "FlowGRPO pipeline", "sampling_extra()")
    if not isinstance(prompt, Mapping) or not isinstance(prompt.get("prompt"), str):
        raise ValueError(f"FlowGRPO pipeline: each prompt must be a dict with a 'prompt' string, got {prompt!r:.80}")
    sample = request_sample(prompt, EXTRA_KEY, ("seed", "index", "group_id"), "FlowGRPO pipeline", "sample_prompt()")
    return (prompt["prompt"], SamplingParams(**raw), int(sample["seed"]), int(sample["index"]),
            int(sample["group_id"]))


def sample_record(s: _Sample, cfg_rescale: bool = True) -> dict[str, Any]:
    """One finished sample as the dict of tensors its request returns ([W, S, C] window latents etc.);
    `cfg_rescale`: how its engine combines true CFG (`DiffusersRolloutEngine.cfg_rescale`)."""
    empty = s.latents.new_zeros(0, *s.latents.shape)
    return {
        "prompt": s.prompt,
        "index": s.index,
        "group_id": s.group_id,
        "seed": s.seed,
        "guidance_scale": float(s.params.guidance_scale),
        "prompt_embeds": s.text.detach().cpu(),
        "negative_prompt_embeds": None if s.neg_text is None else s.neg_text.detach().cpu(),
        "latents": (torch.stack(s.rec_latents) if s.rec_latents else empty).cpu(),
        "next_latents": (torch.stack(s.rec_next) if s.rec_next else empty).cpu(),
        "log_probs": (torch.stack(s.rec_log_probs) if s.rec_log_probs else s.latents.new_zeros(0)).cpu(),
        "sigmas": s.sigmas.cpu(),
        "window_start": s.window_start,
        "image": s.image.detach().cpu(),
        "final_latents": s.latents.detach().float().cpu(),
        "img_shape": tuple(s.img_shape),
        "cfg_rescale": bool(cfg_rescale),
        # a family conditioned on pooled text embeddings (SD3.5, FLUX.1) or a distilled guidance input (FLUX.1-dev)
        "pooled_embeds": None if s.pooled is None else s.pooled.detach().float().cpu(),
        "negative_pooled_embeds": None if s.neg_pooled is None else s.neg_pooled.detach().float().cpu(),
        "distilled_guidance": s.distilled_guidance,
        "clean_tokens": s.clean_tokens,  # an image-to-video sample's clean first-frame tokens (Wan2.2 TI2V)
    }


def record_to_trajectory(records: Sequence[Mapping[str, Any]], params: SamplingParams) -> Trajectory:
    """Stack per-sample records (any order) into the `Trajectory` of the call, rows sorted by index."""
    if not records:
        raise ValueError("no sample records")
    recs = sorted(records, key=lambda r: r["index"])
    for r in recs:
        bad = [k for k in RECORD_TENSORS if k != "negative_prompt_embeds" and not isinstance(r.get(k), torch.Tensor)]
        if bad:
            raise ValueError(f"sample record {r.get('index')} lacks tensors {bad}")
    if len({r["log_probs"].shape[0] for r in recs}) != 1:
        raise RuntimeError("samples recorded different numbers of window steps")
    # A family whose transformer attends to the zero padding (Wan) records the length its forwards padded to.
    length = params.text_length or max((int(r.get("text_length") or 0) for r in recs), default=0) or None
    text, mask = pad_text([r["prompt_embeds"] for r in recs], length)
    neg = neg_mask = None
    if params.do_cfg:
        if any(r["negative_prompt_embeds"] is None for r in recs):
            raise ValueError("a CFG sample record has no negative prompt embeddings")
        neg, neg_mask = pad_text([r["negative_prompt_embeds"] for r in recs], length)
    return Trajectory(
        prompts=[r["prompt"] for r in recs],
        group_ids=torch.tensor([r["group_id"] for r in recs], dtype=torch.long),
        seeds=torch.tensor([r["seed"] for r in recs], dtype=torch.long),
        prompt_embeds=text,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=neg_mask,
        guidance_scale=torch.tensor([r["guidance_scale"] for r in recs], dtype=torch.float32),
        latents=torch.stack([r["latents"] for r in recs]),
        next_latents=torch.stack([r["next_latents"] for r in recs]),
        log_probs=torch.stack([r["log_probs"] for r in recs]),
        sigmas=torch.stack([r["sigmas"] for r in recs]),
        window_start=torch.tensor([r["window_start"] for r in recs], dtype=torch.long),
        images=torch.stack([r["image"] for r in recs]),
        img_shape=tuple(recs[0]["img_shape"]),
        noise_level=params.noise_level if params.stochastic else 0.0,
        sde_type=params.sde_type,
        final_latents=torch.stack([r["final_latents"] for r in recs]),
        cfg_rescale=bool(recs[0].get("cfg_rescale", True)),
        **_conditioning(recs, params),
    )


def _conditioning(recs: Sequence[Mapping[str, Any]], params: SamplingParams) -> dict[str, Any]:
    """The records' conditioning as the diffusers engines fill a `Trajectory`: pooled embeddings [N, P] (and the
    negative prompt's under CFG), distilled guidance [N], an edit pipeline's source tokens (`cond_latents
    [N, S_c, C]`, `cond_shapes`), an image-to-video call's clean first-frame token count (`clean_tokens`); nothing for
    what the family takes none of."""
    out: dict[str, Any] = {}
    if recs[0].get("pooled_embeds") is not None:
        out["pooled_embeds"] = torch.stack([r["pooled_embeds"] for r in recs])
        if params.do_cfg:
            out["negative_pooled_embeds"] = torch.stack([r["negative_pooled_embeds"] for r in recs])
    if recs[0].get("distilled_guidance") is not None:
        out["distilled_guidance"] = torch.tensor([r["distilled_guidance"] for r in recs], dtype=torch.float32)
    if recs[0].get("cond_latents") is not None:
        shapes = {tuple(tuple(g) for g in r["cond_shapes"]) for r in recs}
        if len(shapes) != 1:
            raise ValueError(f"the records of one call must share their source images' grids, got {sorted(shapes)}")
        out.update(cond_latents=torch.stack([r["cond_latents"] for r in recs]), cond_shapes=shapes.pop())
    clean = {int(r.get("clean_tokens") or 0) for r in recs}
    if len(clean) != 1:
        raise ValueError(f"the records of one call mix image-conditioned and unconditioned samples: clean tokens "
                         f"{sorted(clean)}")
    if clean != {0}:
        out["clean_tokens"] = clean.pop()
    return out


# ---------------------------------------------------------------------------------------------- the class


def pipeline_args(pipeline_class: str, vae_dtype: torch.dtype | None = None) -> dict[str, str]:
    """vLLM-Omni's `custom_pipeline_args` for our pipeline class `pipeline_class`, with the VAE's dtype when it is
    not the model's (`rollout.vae_dtype`); `cast_vae` reads it back in the worker."""
    return {"pipeline_class": pipeline_class,
            **({} if vae_dtype is None else {"vae_dtype": str(vae_dtype).removeprefix("torch.")})}


def cast_vae(pipeline: Any, od_config: Any) -> None:
    """Our pipeline classes' VAE in the dtype their `custom_pipeline_args` name (`pipeline_args`), if any, loaded
    from the folder in it (`vae_in_dtype`); vLLM-Omni loaded it in the model's. The stepper's decode casts the latents
    to the VAE's dtype."""
    name = (getattr(od_config, "custom_pipeline_args", None) or {}).get("vae_dtype")
    if name is not None:
        pipeline.vae = vae_in_dtype(pipeline.vae, od_config.model, getattr(torch, name))


def require_qwen_image_vae(model: str) -> None:
    """Refuse a local pipeline folder whose VAE is not an `AutoencoderKLQwenImage`: vLLM-Omni's Qwen-Image
    pipeline loads its `vae/` subfolder as one whatever `model_index.json` says (a pixel-space
    `PixelShuffleVAE` folder would load as a default-sized VAE missing every weight)."""
    index = Path(model) / "model_index.json"
    if not index.is_file():
        return  # a hub id: vLLM-Omni resolves it itself
    vae = json.loads(index.read_text()).get("vae")
    if vae and vae[1] != "AutoencoderKLQwenImage":
        raise ValueError(f"{model}: its VAE is {vae[0]}.{vae[1]}, but vLLM-Omni's Qwen-Image pipeline loads "
                         "only AutoencoderKLQwenImage; sample this folder with the diffusers engine")


def _build_pipeline_class() -> type:
    from diffusers.image_processor import VaeImageProcessor
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

    class FlowGRPOQwenImagePipeline(QwenImagePipeline):
        """vLLM-Omni's Qwen-Image pipeline, denoised by our SDE stepper (see the module docstring)."""

        # Each request carries its own seed, SDE window and record: no vLLM-Omni step execution.
        supports_step_execution = False

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            require_qwen_image_vae(od_config.model)
            super().__init__(od_config=od_config, prefix=prefix)
            cast_vae(self, od_config)
            self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
            self.stepper = SdeStepper(self, max_batch_size=int(getattr(od_config, "max_batch_size", 0) or 8))
            self.full_shapes = self.stepper.full_shapes  # what the worker extension checks updates against
            # An FP8 engine: its weights are (re)loaded through vLLM's layer-wise reload, which needs each layer's
            # checkpoint layout recorded now, before the loader fills and post-processes it (vllm_omni.fp8).
            self.fp8_reloader = None
            if fp8.is_modelopt_fp8(od_config.quantization_config):
                self.fp8_reloader = fp8.attach_reloader(self.transformer, self.full_shapes)

        def rollout(self, prompts: Sequence[str], params: SamplingParams, group_size: int = 1,
                    seeds: Sequence[int] | None = None, on_sample=None) -> Trajectory:
            """The embedded engine's `generate` on this pipeline's components (same trajectory record)."""
            return self.stepper.generate(prompts, params, group_size=group_size, seeds=seeds, on_sample=on_sample)

        @torch.no_grad()
        def forward(self, req: Any) -> list[Any]:
            """One sample per request (see the module docstring); returns one DiffusionOutput per request. vLLM-Omni's
            start-up warm-up request (no FlowGRPO extras) is answered with one ODE sample at its size and steps."""
            if req.is_dummy_run():
                return [self.warm_up(prompt, sp) for prompt, sp in zip(req.prompts, req.sampling_params_list)]
            samples = []
            for prompt, sp in zip(req.prompts, req.sampling_params_list):
                text, params, seed, index, group_id = parse_request(prompt, sp)
                emb = self.stepper.encode_prompts([text])[0]
                neg = self.stepper.encode_prompts([params.negative_prompt])[0] if params.do_cfg else None
                samples.append(self.stepper._new_sample(index, text, group_id, seed, params, emb, neg))
            order = {id(s): i for i, s in enumerate(samples)}
            finished = sorted(self.stepper.run(samples), key=lambda s: order[id(s)])
            outputs = []
            for s in finished:
                record = sample_record(s)
                outputs.append(DiffusionOutput(output=(s.image[None] * 2 - 1),
                                               trajectory_latents=record,
                                               trajectory_log_probs=record["log_probs"][None]))
            return outputs

        def warm_up(self, prompt: Any, sampling: Any) -> Any:
            """vLLM-Omni's warm-up request, run through the stepper as an ODE sample (seed 0): the image only."""
            text = prompt.get("prompt", "") if isinstance(prompt, Mapping) else str(prompt)
            f = self.vae_scale_factor * 2
            params = SamplingParams(height=warm_up_side(sampling.height, f), width=warm_up_side(sampling.width, f),
                                    num_steps=max(1, int(sampling.num_inference_steps or 1)), noise_level=0.0)
            emb = self.stepper.encode_prompts([text])[0]
            (s,) = self.stepper.run([self.stepper._new_sample(0, text, 0, 0, params, emb, None)])
            self.warm_up_shape = tuple(s.image[None].shape)  # what it answered (the worker's `platform_report`)
            return DiffusionOutput(output=(s.image[None] * 2 - 1))

    FlowGRPOQwenImagePipeline.__module__ = __name__
    FlowGRPOQwenImagePipeline.__qualname__ = "FlowGRPOQwenImagePipeline"
    return FlowGRPOQwenImagePipeline


def lazy_classes(module: str, builders: Mapping[str, Callable[[], type]]) -> Callable[[str], type]:
    """A module `__getattr__` that builds each named class on first access (and keeps it), so the module
    imports without the packages the classes subclass."""
    built: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name not in builders:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name not in built:
            built[name] = builders[name]()
        return built[name]

    return __getattr__


__getattr__ = lazy_classes(__name__, {"FlowGRPOQwenImagePipeline": _build_pipeline_class})
