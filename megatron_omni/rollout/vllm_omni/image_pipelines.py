"""Our FlowGRPO SDE pipelines inside vLLM-Omni for SD3.5 and FLUX.1 text-to-image: its `StableDiffusion3Pipeline`
and `FluxPipeline` classes, denoised by OUR stepping code (the SD3 / FLUX counterparts of
`vllm_omni.pipeline.FlowGRPOQwenImagePipeline` and `vllm_omni.wan_pipeline.FlowGRPOWanPipeline`, same request/record
protocol).

`FlowGRPOSD3Pipeline` subclasses vLLM-Omni 0.30.0's `StableDiffusion3Pipeline` (its tensor-parallel
`SD3Transformer2DModel`, CLIP-L/G and T5 encoders, VAE and tokenizers, all loaded by vLLM-Omni's own loader);
`FlowGRPOFluxPipeline` its `FluxPipeline` (tensor-parallel `FluxTransformer2DModel`, CLIP, vLLM-Omni's own T5
encoder, VAE). Each replaces the denoising loop with the embedded engine's of its family (`SD3RolloutEngine`,
`FluxRolloutEngine`: their family hooks over these components): the per-sample generators, the sigma grid (SD3.5's
static shift, FLUX's resolution-dependent one), the SDE step and log-prob, the pooled CLIP embeddings, SD3.5's true
CFG as flow_grpo guides (plain `v_neg + g (v_pos - v_neg)`, `cfg_rescale` False, recorded; 4.5 in its recipes),
FLUX.1-dev's distilled guidance as a model input (3.5 by default, recorded per sample), the decode. So for the same
seeds and weights each gives its diffusers engine's trajectory.

Where this differs from vLLM-Omni's own sampling, on purpose: each request is one sample (seed, SDE window and record
per request, as for Qwen-Image); the text encoders are called one prompt at a time (the engines' embedding cache);
FP8 (an engine built with `fp8.vllm_quantization_config`): the linears the family names (`quantized_linears`) hold
vLLM's FP8 weights, fed from the bridge through `fp8.Fp8WeightReloader` as Qwen-Image's are. FLUX.1's are those
vLLM-Omni's FLUX module builds with the engine's quantization config; vLLM-Omni 0.30.0's SD3 module passes its config
to no linear, so our SD3 class rebuilds the ones SD3.5's family names with it (`fp8.quantize_linears`).

The request's `DiffusionOutput.output` is the image `[1, 3, H, W]` in [-1, 1]; the trajectory record (with the pooled
embeddings and the distilled guidance) is in `trajectory_latents` (`pipeline.sample_record`).

vLLM-Omni is imported lazily: the classes are built on first attribute access (module `__getattr__`), so importing
this module needs neither vllm nor vllm_omni.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from megatron_omni.algorithms.schedule import static_shift_of
from megatron_omni.models.dit.flux_interface import PackedFluxTransformer
from megatron_omni.models.dit.sd3_interface import PackedSD3Transformer
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.flux import FluxRolloutEngine
from megatron_omni.rollout.diffusers_engines.sd3 import SD3RolloutEngine
from megatron_omni.rollout.vllm_omni.pipeline import (
    SdeStepper,
    cast_vae,
    diffusers_shapes,
    lazy_classes,
    parse_request,
    sample_record,
    warm_up_side,
)

SD3_PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.image_pipelines.FlowGRPOSD3Pipeline"
FLUX_PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.image_pipelines.FlowGRPOFluxPipeline"
# The sincos position table of SD3's patch embedding is a buffer both sides compute from the config: never sent.
SD3_CONSTANTS = ("pos_embed.pos_embed",)
# vLLM-Omni's `load_weights` of both transformers fuses these diffusers projections into one parameter
FUSED = {".to_q.": ".to_qkv.", ".to_k.": ".to_qkv.", ".to_v.": ".to_qkv.", ".add_q_proj.": ".add_kv_proj.",
         ".add_k_proj.": ".add_kv_proj.", ".add_v_proj.": ".add_kv_proj."}


def _transformer_config(folder: str | os.PathLike) -> dict[str, Any]:
    return {k: v for k, v in json.loads((Path(folder) / "transformer" / "config.json").read_text()).items()
            if not k.startswith("_")}


def check_folder(folder: str | os.PathLike) -> None:
    """What our SD3 / FLUX classes refuse about a folder, checked before an engine starts (`engine.start_omni`: a
    worker's start-up error reaches the caller without its cause): a transformer config the family cannot hold
    (SD3.0's missing QK norm, FLUX axes that do not sum to the head dim: the families' own checks)."""
    index = json.loads((Path(folder) / "model_index.json").read_text())
    if index.get("_class_name") == "StableDiffusion3Pipeline":
        from model_providers.sd3.provider import hf_config
    else:
        from model_providers.flux.provider import hf_config
    hf_config(_transformer_config(folder))


def fused_loader(load: Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]]) -> Callable:
    """vLLM-Omni's transformer `load_weights` taking our loaders' names: `transformer.`-prefixed ones unprefixed (its
    own loader strips the prefix before calling it), and reporting a fused q/k/v tensor by its diffusers name too
    (SD3's reports only the fused parameter), so `load_transformer_weights` sees every tensor it took."""

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        items = [(n.removeprefix("transformer."), t) for n, t in weights]
        loaded = set(load(items))
        for name, _ in items:
            fused = next((name.replace(k, v) for k, v in FUSED.items() if k in name), None)
            if fused is not None and fused in loaded:
                loaded.add(name)
        return loaded

    return load_weights


class _Configured:
    """vLLM-Omni's transformer with the diffusers `config` fields our packed wrappers read (it has none)."""

    def __init__(self, module: torch.nn.Module, **config: Any) -> None:
        self.module = module
        self.config = SimpleNamespace(**config)

    def __call__(self, **kwargs: Any) -> Any:
        return self.module(**kwargs)


class SD3SdeStepper(SdeStepper, SD3RolloutEngine):
    """The embedded SD3.5 engine's loop (`SD3RolloutEngine`'s hooks: latents, static-shift grid, CLIP + T5 text with
    the pooled embeddings, plain CFG, decode) over a vLLM-Omni SD3 pipeline's components."""

    def _config_view(self, pipeline: Any) -> dict[str, Any]:
        t = pipeline.transformer
        return {"in_channels": int(t.in_channels), "patch_size": int(t.patch_size)}

    def _pipeline_shift(self, pipeline: Any) -> float:
        return static_shift_of(pipeline.scheduler.config)

    def _velocity(self, pipeline: Any) -> PackedSD3Transformer:
        t = pipeline.transformer
        return PackedSD3Transformer(_Configured(t, patch_size=int(t.patch_size)))

    def _full_shapes(self, pipeline: Any) -> dict[str, tuple[int, ...]]:
        shapes = diffusers_shapes(_transformer_config(pipeline.od_config.model), "SD3Transformer2DModel")
        return {n: s for n, s in shapes.items() if n not in SD3_CONSTANTS}

    def _pipeline_encode(self, prompt: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM-Omni's encode_prompt: the same states as diffusers' (CLIP-L | CLIP-G penultimate, padded, then T5)
        return self.pipe.encode_prompt(prompt=prompt, prompt_2=None, prompt_3=None, max_sequence_length=max_length)


class FluxSdeStepper(SdeStepper, FluxRolloutEngine):
    """The embedded FLUX.1 engine's loop (`FluxRolloutEngine`'s hooks: packed latents, the resolution-shifted grid,
    T5 text with CLIP's pooled output, the distilled guidance input, decode) over a vLLM-Omni FLUX pipeline's
    components."""

    def _config_view(self, pipeline: Any) -> dict[str, Any]:
        t = pipeline.transformer
        return {"in_channels": int(t.in_channels), "guidance_embeds": bool(t.guidance_embeds)}

    def _velocity(self, pipeline: Any) -> PackedFluxTransformer:
        t = pipeline.transformer
        return PackedFluxTransformer(_Configured(t, guidance_embeds=bool(t.guidance_embeds)))

    def _full_shapes(self, pipeline: Any) -> dict[str, tuple[int, ...]]:
        return diffusers_shapes(_transformer_config(pipeline.od_config.model), "FluxTransformer2DModel")

    def _pipeline_encode(self, prompt: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompt, prompt_2=None, max_sequence_length=max_length)
        return embeds, pooled


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str, subfolder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(folder) / subfolder, local_files_only=True)


def sd3_text_lengths(folder: str | os.PathLike, prompts: Sequence[str]) -> list[int]:
    """T5 tokens of each prompt before the pipeline pads it (the SD3 engine's `text_lengths`, on every rank)."""
    return [len(_tokenizer(str(folder), "tokenizer_3")(p).input_ids) for p in prompts]


def flux_text_lengths(folder: str | os.PathLike, prompts: Sequence[str]) -> list[int]:
    """T5 tokens of each prompt before the pipeline pads it (the FLUX engine's `text_lengths`, on every rank)."""
    return [len(_tokenizer(str(folder), "tokenizer_2")(p).input_ids) for p in prompts]


class _FlowGRPOImage:
    """What both classes add to vLLM-Omni's pipeline (mixed in before it): the stepper's rollout, the one-sample
    requests, the warm-up. `stepper` and `full_shapes` are set by `_setup`."""

    supports_step_execution = False  # each request carries its own seed, SDE window and record

    family = ""  # the model family (its vLLM-Omni rollout layout and quantized linears)

    def _setup(self, stepper_class: type) -> None:
        from megatron_omni.rollout.vllm_omni import fp8

        cast_vae(self, self.od_config)
        self.transformer.load_weights = fused_loader(self.transformer.load_weights)
        self.stepper = stepper_class(self, max_batch_size=int(getattr(self.od_config, "max_batch_size", 0) or 8))
        self.full_shapes = self.stepper.full_shapes  # what the worker extension checks updates against
        # An FP8 engine: its linears are (re)loaded through vLLM's layer-wise reload, which needs each layer's
        # checkpoint layout recorded now, before vLLM-Omni's loader fills and post-processes it (vllm_omni.fp8).
        self.fp8_reloader = None
        quant_config = self.od_config.quantization_config
        if fp8.is_modelopt_fp8(quant_config):
            layout = self.rollout_layout()
            self._quantize_linears(layout, quant_config)
            self.fp8_reloader = fp8.attach_reloader(self.transformer, self.full_shapes, layout)

    def rollout_layout(self) -> Any:
        """The family's vLLM-Omni rollout layout (the bridge's `rule(hf name)`: FP8 names, LoRA module names)."""
        import importlib

        return importlib.import_module(f"model_providers.{self.family}.rollout_layouts").rollout_layout("vllm_omni")

    def _quantize_linears(self, layout: Any, quant_config: Any) -> None:
        """Give the family's quantized linears vLLM's FP8 method where vLLM-Omni's module did not (nothing here)."""

    def rollout(self, prompts: Sequence[str], params: SamplingParams, group_size: int = 1,
                seeds: Sequence[int] | None = None, on_sample=None) -> Any:
        """The embedded engine's `generate` on this pipeline's components (same trajectory record)."""
        return self.stepper.generate(prompts, params, group_size=group_size, seeds=seeds, on_sample=on_sample)

    def _sample(self, index: int, text: str, group_id: int, seed: int, params: SamplingParams) -> Any:
        st = self.stepper
        emb = st.encode_prompts([text], params.max_sequence_length)[0]
        neg = st.encode_prompts([params.negative_prompt], params.max_sequence_length)[0] if params.do_cfg else None
        return st._new_sample(index, text, group_id, seed, params, emb, neg)

    @torch.no_grad()
    def forward(self, req: Any) -> list[Any]:
        """One sample per request; one DiffusionOutput per request (image in [-1, 1], the record). vLLM-Omni's
        start-up warm-up request (no FlowGRPO extras) is answered with one ODE sample at its steps and its size
        (`warm_up_side`: at most 64 pixels a side where no GPU is)."""
        from vllm_omni.diffusion.data import DiffusionOutput

        if req.is_dummy_run():
            return [self.warm_up(prompt, sp) for prompt, sp in zip(req.prompts, req.sampling_params_list)]
        samples = [self._sample(index, text, group_id, seed, params)
                   for text, params, seed, index, group_id in (parse_request(p, sp) for p, sp in
                                                               zip(req.prompts, req.sampling_params_list))]
        order = {id(s): i for i, s in enumerate(samples)}
        outputs = []
        for s in sorted(self.stepper.run(samples), key=lambda s: order[id(s)]):
            record = sample_record(s, self.stepper.cfg_rescale)
            outputs.append(DiffusionOutput(output=s.image[None] * 2 - 1, trajectory_latents=record,
                                           trajectory_log_probs=record["log_probs"][None]))
        return outputs

    def warm_up(self, prompt: Any, sampling: Any) -> Any:
        """vLLM-Omni's warm-up request, run through the stepper as one ODE sample (seed 0): the image only."""
        from vllm_omni.diffusion.data import DiffusionOutput

        text = prompt.get("prompt", "") if isinstance(prompt, Mapping) else str(prompt)
        f = self.vae_scale_factor * 2
        # vLLM-Omni asks for its default size (e.g. 1024); SD3's position table crops at most
        # `pos_embed_max_size` patches a side, which a small model's folder may not reach (the tiny one's: 12)
        limit = self._largest_side() // f * f

        def side(asked: Any) -> int:
            return min(warm_up_side(asked, f), limit)

        params = SamplingParams(height=side(sampling.height), width=side(sampling.width), noise_level=0.0,
                                num_steps=max(1, int(sampling.num_inference_steps or 1)), max_sequence_length=16)
        (s,) = self.stepper.run([self._sample(0, text or "a", 0, 0, params)])
        return DiffusionOutput(output=s.image[None] * 2 - 1)

    def _largest_side(self) -> int:
        """The largest image side in pixels the transformer takes (no limit by default)."""
        return 1 << 30


def _build_sd3_class() -> type:
    from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline

    class FlowGRPOSD3Pipeline(_FlowGRPOImage, StableDiffusion3Pipeline):
        """vLLM-Omni's SD3 pipeline, denoised by our SDE stepper (see the module docstring)."""

        family = "sd3"

        def _quantize_linears(self, layout: Any, quant_config: Any) -> None:
            from megatron_omni.rollout.quantization import QuantizationSpec, quantized_names
            from megatron_omni.rollout.vllm_omni.fp8 import quantize_linears
            from model_providers import get_family

            spec = QuantizationSpec("fp8", tuple(get_family("sd3").quantized_linears))
            modules = {layout.rule(n)[0].removesuffix(".weight") for n in quantized_names(self.full_shapes, spec)}
            quantize_linears(self.transformer, modules, quant_config)

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            check_folder(od_config.model)
            StableDiffusion3Pipeline.__init__(self, od_config=od_config, prefix=prefix)
            self._setup(SD3SdeStepper)

        def _largest_side(self) -> int:
            t = self.transformer  # PatchEmbed crops its sincos table to the latent grid
            return int(t.pos_embed_max_size) * int(t.patch_size) * self.vae_scale_factor

    FlowGRPOSD3Pipeline.__module__ = __name__
    FlowGRPOSD3Pipeline.__qualname__ = "FlowGRPOSD3Pipeline"
    return FlowGRPOSD3Pipeline


def _build_flux_class() -> type:
    from diffusers.image_processor import VaeImageProcessor
    from vllm_omni.diffusion.models.flux.pipeline_flux import FluxPipeline

    class FlowGRPOFluxPipeline(_FlowGRPOImage, FluxPipeline):
        """vLLM-Omni's FLUX.1 pipeline, denoised by our SDE stepper (see the module docstring)."""

        family = "flux"

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            check_folder(od_config.model)
            FluxPipeline.__init__(self, od_config=od_config, prefix=prefix)
            # FluxPipeline's post-processing of packed 2 x 2 latents (vLLM-Omni builds it only in its post-process)
            self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
            # vLLM-Omni's LoRA manager learns which diffusers projections a fused layer packs from a module's
            # `stacked_params_mapping` attribute (SD3's `load_weights` sets one); its FLUX module declares them only
            # as `packed_modules_mapping`, so an adapter on `to_q` would not bind to `to_qkv` without this
            t = self.transformer
            if getattr(t, "stacked_params_mapping", None) is None:
                t.stacked_params_mapping = [(f".{packed}", f".{part}", shard) for packed, parts in
                                            t.packed_modules_mapping.items() for part, shard in zip(parts, "qkv")]
            self._setup(FluxSdeStepper)

    FlowGRPOFluxPipeline.__module__ = __name__
    FlowGRPOFluxPipeline.__qualname__ = "FlowGRPOFluxPipeline"
    return FlowGRPOFluxPipeline


__getattr__ = lazy_classes(__name__, {"FlowGRPOSD3Pipeline": _build_sd3_class,
                                      "FlowGRPOFluxPipeline": _build_flux_class})
