"""Our FlowGRPO SDE pipeline inside vLLM-Omni for image editing: its Qwen-Image edit plus pipeline class, denoised by
OUR stepping code (the edit counterpart of `vllm_omni.pipeline.FlowGRPOQwenImagePipeline`, same request/record
protocol).

`FlowGRPOQwenImageEditPipeline` subclasses vLLM-Omni 0.30.0's `QwenImageEditPlusPipeline` (its components: the
tensor-parallel `QwenImageTransformer2DModel`, the Qwen2.5-VL text encoder and processor, the VAE, all loaded by
vLLM-Omni's own loader) and replaces its denoising loop with the embedded edit engine's (`EditSdeStepper`:
`EditRolloutEngine`'s hooks over these components): each record's source images resized to the folder's areas
(`edit_config.json`, else diffusers' 384^2 / 1024^2), the text encoder reading them with the instruction, their VAE
latents appended to the image stream, true CFG with the negative prompt encoded with the same sources, and the
Qwen-Image sigma grid, SDE step, log-prob and decode. So for the same records, seeds and weights it gives the
diffusers edit engine's trajectory, source tokens included.

A request's prompt is the edit record's prompt string (`EditRecord.prompt`); its `DiffusionOutput.output` is the
image in [-1, 1] and `trajectory_latents` the record (`pipeline.sample_record` plus `cond_latents [S_c, C]` and
`cond_shapes`, which `record_to_trajectory` stacks into the Trajectory).

On CPU, transformers' `Qwen2VLProcessor` cannot be built (its video processor needs torchvision, which does not
install beside the CPU torch): vLLM-Omni's constructor then gets `processor.ImageOnlyQwen2VLProcessor` in its place
(the same tokenizer and image processor; the folder is unchanged). Imported lazily like the other pipeline classes.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.edit import EditRolloutEngine
from megatron_omni.rollout.vllm_omni.pipeline import (
    SdeStepper,
    VllmOmniVelocity,
    cast_vae,
    lazy_classes,
    parse_request,
    require_qwen_image_vae,
    sample_record,
)

EDIT_PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.edit_pipeline.FlowGRPOQwenImageEditPipeline"
VLLM_EDIT_MODULE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus"


class EditSdeStepper(SdeStepper, EditRolloutEngine):
    """The embedded edit engine's loop (`EditRolloutEngine`'s hooks: sources, per-record negatives, conditioning
    tokens) over a vLLM-Omni Qwen-Image edit plus pipeline's components (`SdeStepper`'s construction and loading)."""

    def __init__(self, pipeline: Any, max_batch_size: int = 8, embed_cache_size: int = 4096) -> None:  # noqa: D107
        super().__init__(pipeline, max_batch_size, embed_cache_size)
        self._edit_state(pipeline.od_config.model)

    def _velocity(self, pipeline: Any) -> VllmOmniVelocity:
        return VllmOmniVelocity(pipeline.transformer)

    def _text_embeds(self, text: str, conditions: list) -> torch.Tensor:
        # vLLM-Omni's `_get_qwen_prompt_embeds` takes no device (its own); the template and processor are diffusers'
        out, _ = self.pipe._get_qwen_prompt_embeds(prompt=[text], image=conditions, dtype=self.dtype)
        return out[0].float().clone()


@functools.lru_cache(maxsize=4)
def _counter(folder: str) -> Any:
    """A diffusers `QwenImageEditPlusPipeline` holding only the folder's processor (its template and resizing)."""
    from diffusers import QwenImageEditPlusPipeline

    from model_providers.qwen_image_edit.processor import load_processor

    processor = load_processor(folder)
    return QwenImageEditPlusPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=processor.tokenizer,
                                     processor=processor, transformer=None)


def text_lengths(folder: str | os.PathLike, prompts: Sequence[str]) -> list[int]:
    """Text tokens each edit prompt string gives the transformer: the edit template with a "Picture k" placeholder
    per source, expanded by the processor into the sources' vision tokens, minus the dropped template prefix (the
    engine's `text_lengths` for an edit folder, on every rank, without the text encoder; a CFG call's negative is
    counted as `data.negative_record`)."""
    from model_providers.qwen_image_edit.conditioning import EditAreas
    from model_providers.qwen_image_edit.data import EditRecord

    pipe, areas = _counter(str(folder)), EditAreas.of_folder(folder)
    out = []
    for p in prompts:
        record = EditRecord.parse(p)
        images = [pipe.image_processor.resize(im, *areas.condition_size(*im.size)[::-1]) for im in record.load_images()]
        pictures = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(images)))
        text = pipe.prompt_template_encode.format(pictures + record.instruction)
        ids = pipe.processor(text=[text], images=images, padding=True, return_tensors="pt").input_ids
        out.append(int(ids.shape[1]) - pipe.prompt_template_encode_start_idx)
    return out


@contextlib.contextmanager
def _processor_without_torchvision(module: Any):
    """vLLM-Omni's constructor loads `Qwen2VLProcessor`; where torchvision is missing it gets our image-only
    subclass (see the module docstring), elsewhere transformers' own."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    from unittest import mock

    class _Loader:
        @staticmethod
        def from_pretrained(model: str, subfolder: str = "processor", **_: Any) -> Any:
            from model_providers.qwen_image_edit.processor import load_processor

            if Path(model, subfolder) != Path(model) / "processor":
                raise ValueError(f"{model}: the processor is read from processor/, not {subfolder}/")
            return load_processor(model)

    with mock.patch.object(module, "Qwen2VLProcessor", _Loader):
        yield


def _build_pipeline_class() -> type:
    import importlib

    from diffusers.image_processor import VaeImageProcessor
    from vllm_omni.diffusion.data import DiffusionOutput

    from megatron_omni.rollout.vllm_omni.fp8 import is_modelopt_fp8

    module = importlib.import_module(VLLM_EDIT_MODULE)

    class FlowGRPOQwenImageEditPipeline(module.QwenImageEditPlusPipeline):
        """vLLM-Omni's Qwen-Image edit plus pipeline, denoised by our SDE stepper (see the module docstring)."""

        supports_step_execution = False

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            require_qwen_image_vae(od_config.model)
            if is_modelopt_fp8(od_config.quantization_config):
                raise ValueError("the vLLM-Omni edit pipeline runs unquantized (FP8 is Qwen-Image's text-to-image "
                                 "pipeline's)")
            with _processor_without_torchvision(module):
                super().__init__(od_config=od_config, prefix=prefix)
            cast_vae(self, od_config)
            # diffusers' edit pipeline's (vLLM-Omni's converts to RGB first: our sources are RGB already)
            self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
            self.stepper = EditSdeStepper(self, max_batch_size=int(getattr(od_config, "max_batch_size", 0) or 8))
            self.full_shapes = self.stepper.full_shapes  # what the worker extension checks updates against

        def rollout(self, prompts, params: SamplingParams, group_size: int = 1, seeds=None, on_sample=None):
            """The embedded edit engine's `generate` on this pipeline's components (same trajectory record)."""
            return self.stepper.generate(prompts, params, group_size=group_size, seeds=seeds, on_sample=on_sample)

        @torch.no_grad()
        def forward(self, req: Any) -> list[Any]:
            """One sample per request (an edit record's prompt string); one DiffusionOutput per request (image in
            [-1, 1], the record with the source tokens). vLLM-Omni's warm-up request has no FlowGRPO extras and no
            record: it is answered with a black image of its size (nothing to edit)."""
            if req.is_dummy_run():
                return [DiffusionOutput(output=-torch.ones(1, 3, int(sp.height or 64), int(sp.width or 64)))
                        for sp in req.sampling_params_list]
            st = self.stepper
            samples = []
            for prompt, sp in zip(req.prompts, req.sampling_params_list):
                text, params, seed, index, group_id = parse_request(prompt, sp)
                emb = st.encode_prompts([text])[0]
                neg = st.negative(text, params.negative_prompt) if params.do_cfg else None
                longest = max(emb.shape[0], 0 if neg is None else neg.shape[0])
                samples.append(st._new_sample(index, text, group_id, seed, params, emb, neg,
                                              st._call_text_length(longest, params)))
            order = {id(s): i for i, s in enumerate(samples)}
            outputs = []
            for s in sorted(st.run(samples), key=lambda s: order[id(s)]):
                record = {**sample_record(s, st.cfg_rescale), "cond_latents": s.cond_latents.detach().float().cpu(),
                          "cond_shapes": tuple(tuple(g) for g in s.cond_shapes), "text_length": s.text_length}
                outputs.append(DiffusionOutput(output=(s.image[None] * 2 - 1), trajectory_latents=record,
                                               trajectory_log_probs=record["log_probs"][None]))
            return outputs

    FlowGRPOQwenImageEditPipeline.__module__ = __name__
    FlowGRPOQwenImageEditPipeline.__qualname__ = "FlowGRPOQwenImageEditPipeline"
    return FlowGRPOQwenImageEditPipeline


__getattr__ = lazy_classes(__name__, {"FlowGRPOQwenImageEditPipeline": _build_pipeline_class})
