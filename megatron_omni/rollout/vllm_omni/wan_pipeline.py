"""Our FlowGRPO SDE pipeline inside vLLM-Omni for Wan text-to-video: its Wan2.2 pipeline class, denoised by OUR
stepping code (the Wan counterpart of `vllm_omni.pipeline.FlowGRPOQwenImagePipeline`, same request/record protocol).

`FlowGRPOWanPipeline` subclasses vLLM-Omni 0.30.0's `Wan22Pipeline` (its components: the tensor-parallel Wan2.2
`WanTransformer3DModel`, the UMT5 text encoder, Wan's VAE, the tokenizer, all loaded by vLLM-Omni's own loader) and
replaces its denoising loop with the embedded Wan engine's (`WanSdeStepper`: `WanRolloutEngine`'s family hooks over
these components): the per-sample generators, the static-shift sigma grid, the SDE step and log-prob, true CFG as
`WanPipeline` guides (plain, `cfg_rescale` False, recorded), the decode and video post-processing. So for the same
seeds and weights it gives the diffusers Wan engine's trajectory.

Where this differs from vLLM-Omni's own Wan sampling, on purpose:
- the sigma grid is the FOLDER's scheduler's static shift (what `WanPipeline` and the embedded engine sample), not
  vLLM-Omni's UniPC solver at `od_config.flow_shift` (default 5.0): the trainer's recompute follows the rollout;
- each request is one sample (seed, SDE window and record per request), as for Qwen-Image;
- a Wan2.2-TI2V folder (`expand_timesteps`, e.g. TI2V-5B) is sampled as the embedded engine samples it: per-token
  timesteps in every forward, and an image-record prompt (`EditRecord.prompt`) samples image-to-video with the image's
  first-frame latents as clean tokens at timestep 0 (`Trajectory.clean_tokens`, carried in the record); vLLM-Omni's
  own I2V path (the image in `multi_modal_data`, its mask blend) is not used: the record is the prompt string;
- the two-expert (A14B) folders are refused by name (the embedded engine samples them); FP8 is refused (the Wan
  family names no quantized linears); so is a head dim whose RoPE vLLM-Omni 0.30 slices wrongly
  (`check_rope_split`: the `tiny` preset's 16; every published Wan's 128 is right).

The request's `DiffusionOutput.output` is the video `[1, 3, F, H, W]` in [-1, 1] (the layout vLLM-Omni's Wan
post-processing reads); the trajectory record is in `trajectory_latents` (`pipeline.sample_record`).

vLLM-Omni's Wan package cannot be imported as a package on CPU (its `__init__` imports the image-to-video pipeline,
which imports torchvision): `wan2_2_module` enters it without its `__init__`. The class is built on first attribute
access (module `__getattr__`), so importing this module needs neither vllm nor vllm_omni.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from megatron_omni.algorithms.schedule import static_shift_of
from megatron_omni.models.dit.video_interface import PackedVideoTransformer
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.wan import WanRolloutEngine, wan_token_ids
from megatron_omni.rollout.vllm_omni.pipeline import (
    SdeStepper,
    cast_vae,
    diffusers_shapes,
    lazy_classes,
    parse_request,
    sample_record,
    single_stage_devices,
    warm_up_side,
)

WAN_PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.wan_pipeline.FlowGRPOWanPipeline"
# vLLM-Omni's Wan loader stores the model's own table under another name and reports that name loaded
# (model_providers/wan/rollout_layouts.py declares the same place for the bridge).
WEIGHT_RENAMES = {"scale_shift_table": "output_scale_shift_prepare.scale_shift_table"}


def wan2_2_module(name: str) -> ModuleType:
    """`vllm_omni.diffusion.models.wan2_2.<name>`, imported without running the package's `__init__` where
    torchvision is missing (`plugin.bare_wan_package`; see the module docstring)."""
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

    install_import_shims()
    return importlib.import_module(f"vllm_omni.diffusion.models.wan2_2.{name}")


def folder_shift(model: str) -> float:
    """The static flow shift of the pipeline folder's scheduler (`scheduler/scheduler_config.json`)."""
    path = Path(model) / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model}: no scheduler/scheduler_config.json (the sigma grid's shift is the folder's)")
    return static_shift_of(json.loads(path.read_text()))


def require_one_expert(model: str) -> None:
    """Refuse what the stepper does not sample: a two-expert folder (`transformer_2/`, Wan2.2 A14B)."""
    if (Path(model) / "transformer_2").exists():
        raise ValueError(f"{model}: two-expert (Wan2.2 A14B) Wan pipelines are not supported by the vLLM-Omni Wan "
                         "pipeline yet; the embedded engine samples them (rollout.engine=diffusers)")


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(folder) / "tokenizer", local_files_only=True)


def text_lengths(folder: str | os.PathLike, prompts: Sequence[str]) -> list[int]:
    """Text tokens each prompt gives Wan's transformer before the zero padding, counted with the folder's tokenizer
    as `WanPipeline` tokenizes (the engine's `text_lengths` for a Wan folder, on every rank)."""
    from model_providers.qwen_image_edit.data import EditRecord

    tokenizer = _tokenizer(str(folder))
    # an image-to-video prompt (a TI2V folder) is an image record: its instruction is the text
    return [len(wan_token_ids(tokenizer, EditRecord.parse(p).instruction if p.startswith("{") else p))
            for p in prompts]


def check_rope_split(config: dict[str, Any]) -> None:
    """Refuse a head dim d whose RoPE vLLM-Omni 0.30's Wan2.2 transformer gets wrong: it builds its tables for
    (frames, height, width) channels `d - 4 (d // 6), 2 (d // 6), 2 (d // 6)` (diffusers' split) but slices them
    at `d - 2 (d // 3), d // 3, d // 3`; the two agree for every published Wan (d = 128) but not for, e.g., d = 16
    (8/4/4 against 6/5/5: its attention then differs from diffusers' by ~3e-3)."""
    d = int(config["attention_head_dim"])
    if d // 3 != 2 * (d // 6):
        raise ValueError(f"attention_head_dim={d}: vLLM-Omni 0.30's Wan RoPE slices its (frames, height, width) "
                         f"tables at {d - 2 * (d // 3)}/{d // 3}/{d // 3} channels but builds them at "
                         f"{d - 4 * (d // 6)}/{2 * (d // 6)}/{2 * (d // 6)} (diffusers'): sample this folder with "
                         "the diffusers engine")


def stage_overrides(tp: int) -> dict[str, dict[str, str]]:
    """vLLM-Omni 0.30 deploys a Wan2.2 folder with its bundled `deploy/wan2_2_ti2v.yaml`, which pins stage 0 to
    `devices: "0"`: at rollout tp > 1 its stage set-up then refuses ("requires 2 device(s) ... 1 device(s) are
    available"). The stage takes devices 0..tp-1 (of the GPUs the engine's owner was given, numbered from 0)."""
    return single_stage_devices(tp)


def check_folder(folder: str | os.PathLike) -> None:
    """Everything `FlowGRPOWanPipeline` refuses about a folder (`require_one_expert`, `check_rope_split`), checked
    before an engine starts (`engine.start_omni`: a worker's start-up error reaches the caller without its cause)."""
    require_one_expert(str(folder))
    check_rope_split(json.loads((Path(folder) / "transformer" / "config.json").read_text()))


class WanSdeStepper(SdeStepper, WanRolloutEngine):
    """The embedded Wan engine's loop (`WanRolloutEngine`'s hooks: latents, grid, text, decode, plain CFG) over a
    vLLM-Omni Wan2.2 pipeline's components (`SdeStepper`'s construction and loading)."""

    weight_renames = WEIGHT_RENAMES

    def _config_view(self, pipeline: Any) -> dict[str, Any]:
        cfg = pipeline.transformer.config
        return {"in_channels": int(cfg.in_channels), "patch_size": tuple(cfg.patch_size)}

    def _pipeline_shift(self, pipeline: Any) -> float:
        return folder_shift(pipeline.od_config.model)

    def _velocity(self, pipeline: Any) -> PackedVideoTransformer:
        # vLLM-Omni's pipeline reads `expand_timesteps` from the folder's model_index.json (Wan2.2-TI2V)
        self.expand_timesteps = bool(getattr(pipeline, "expand_timesteps", False))
        return PackedVideoTransformer(pipeline.transformer, tuple(pipeline.transformer.config.patch_size),
                                      expand_timesteps=self.expand_timesteps)

    def _full_shapes(self, pipeline: Any) -> dict[str, tuple[int, ...]]:
        config = json.loads((Path(pipeline.od_config.model) / "transformer" / "config.json").read_text())
        return diffusers_shapes(config, "WanTransformer3DModel")


def _build_pipeline_class() -> type:
    from diffusers.video_processor import VideoProcessor
    from vllm_omni.diffusion.data import DiffusionOutput

    from megatron_omni.rollout.vllm_omni.fp8 import is_modelopt_fp8

    Wan22Pipeline = wan2_2_module("pipeline_wan2_2").Wan22Pipeline

    class FlowGRPOWanPipeline(Wan22Pipeline):
        """vLLM-Omni's Wan2.2 text-to-video pipeline, denoised by our SDE stepper (see the module docstring)."""

        supports_step_execution = False
        weight_renames = WEIGHT_RENAMES  # read by the worker extension's weight receiver

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            check_folder(od_config.model)
            if is_modelopt_fp8(od_config.quantization_config):
                raise ValueError("the vLLM-Omni Wan pipeline runs unquantized (the Wan family names no FP8 linears)")
            super().__init__(od_config=od_config, prefix=prefix)
            cast_vae(self, od_config)
            self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)  # WanPipeline's
            # Our loaders (the bridge's full mode, the worker's buckets) send `transformer.`-prefixed names to the
            # transformer's own `load_weights`; vLLM-Omni's Wan transformer takes them unprefixed (Qwen-Image's
            # strips the prefix itself).
            load = self.transformer.load_weights
            self.transformer.load_weights = lambda weights: load((n.removeprefix("transformer."), t)
                                                                 for n, t in weights)
            self.stepper = WanSdeStepper(self, max_batch_size=int(getattr(od_config, "max_batch_size", 0) or 8))
            self.full_shapes = self.stepper.full_shapes  # what the worker extension checks updates against

        def rollout(self, prompts, params: SamplingParams, group_size: int = 1, seeds=None, on_sample=None):
            """The embedded engine's `generate` on this pipeline's components (same trajectory record)."""
            return self.stepper.generate(prompts, params, group_size=group_size, seeds=seeds, on_sample=on_sample)

        @torch.no_grad()
        def forward(self, req: Any) -> list[Any]:
            """One sample per request; one DiffusionOutput per request (video in [-1, 1], the record). vLLM-Omni's
            start-up warm-up request (no FlowGRPO extras) is answered with one ODE sample at its size and steps."""
            if req.is_dummy_run():
                return [self.warm_up(prompt, sp) for prompt, sp in zip(req.prompts, req.sampling_params_list)]
            samples = []
            for prompt, sp in zip(req.prompts, req.sampling_params_list):
                text, params, seed, index, group_id = parse_request(prompt, sp)
                samples.append(self._sample(index, text, group_id, seed, params))
            order = {id(s): i for i, s in enumerate(samples)}
            finished = sorted(self.stepper.run(samples), key=lambda s: order[id(s)])
            outputs = []
            for s in finished:
                # Wan attends to the zero padding: the trajectory pads the text to what the forwards padded to
                record = {**sample_record(s, self.stepper.cfg_rescale), "text_length": s.text_length}
                outputs.append(DiffusionOutput(output=self._video_output(s.image), trajectory_latents=record,
                                               trajectory_log_probs=record["log_probs"][None]))
            return outputs

        def _sample(self, index: int, text: str, group_id: int, seed: int, params: SamplingParams) -> Any:
            st = self.stepper
            emb = st.encode_prompts([text], params.max_sequence_length)[0]
            neg = st.encode_prompts([params.negative_prompt], params.max_sequence_length)[0] if params.do_cfg else None
            longest = max(emb.shape[0], 0 if neg is None else neg.shape[0])
            return st._new_sample(index, text, group_id, seed, params, emb, neg, st._call_text_length(longest, params))

        @staticmethod
        def _video_output(frames: torch.Tensor) -> torch.Tensor:
            """Frames [F, 3, H, W] in [0, 1] -> [1, 3, F, H, W] in [-1, 1]."""
            return (frames.permute(1, 0, 2, 3)[None] * 2 - 1).contiguous()

        def warm_up(self, prompt: Any, sampling: Any) -> Any:
            """vLLM-Omni's warm-up request, run through the stepper as one ODE sample (seed 0) at its frames and
            `warm_up_side` (at most 64 pixels a side where no GPU is): the video only."""
            text = prompt.get("prompt", "") if isinstance(prompt, dict) else str(prompt)
            t, s = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial * 2
            frames = int(sampling.num_frames or 1 + t)
            params = SamplingParams(height=warm_up_side(sampling.height, s), width=warm_up_side(sampling.width, s),
                                    num_frames=(frames - 1) // t * t + 1, noise_level=0.0,
                                    num_steps=max(1, int(sampling.num_inference_steps or 1)))
            (sample,) = self.stepper.run([self._sample(0, text or "a", 0, 0, params)])
            return DiffusionOutput(output=self._video_output(sample.image))

    FlowGRPOWanPipeline.__module__ = __name__
    FlowGRPOWanPipeline.__qualname__ = "FlowGRPOWanPipeline"
    return FlowGRPOWanPipeline


__getattr__ = lazy_classes(__name__, {"FlowGRPOWanPipeline": _build_pipeline_class})
