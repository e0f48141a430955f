"""The embedded rollout engine for image editing: `QwenImageEditPlusPipeline`'s components from a diffusers folder,
driven by the image engine's SDE step and continuous batching (`DiffusersRolloutEngine`, whose family hooks this
overrides), producing the same `Trajectory` plus the sources' latents.

- Prompts are edit records' prompt strings (`model_providers.qwen_image_edit.data.EditRecord.prompt`: the source
  images' paths, the instruction, metadata); rewards receive the same strings.
- Per record, as the pipeline computes them (`model_providers.qwen_image_edit.conditioning`): the Qwen2.5-VL
  text encoder reads every source resized to the condition area ("Picture 1: ..., Picture 2: ...") plus the
  instruction in the edit template; the VAE encodes each source resized to the VAE area (`argmax` of the latent
  distribution: no sampling), normalised and packed, the sources' tokens concatenated in the record's order. Both
  are cached by the prompt string (GRPO repeats each record G times).
- Every forward's image stream is `[latents | source 1 | source 2 | ...]` with `img_shapes = [[grid, source
  grids...]]`; the velocity is the first `S` tokens'. The source tokens go into the Trajectory (`cond_latents`,
  `cond_shapes`) and the trainer's recompute appends those very tensors, so it sees what the rollout saw.
- True CFG as the pipeline applies it (`true_cfg_scale` = `SamplingParams.guidance_scale` with a negative prompt):
  the negative prompt is encoded with each record's source images (its own text embedding per record, cached by
  (negative prompt, record)), the negative row's image stream carries the same source tokens, and the guided
  velocity is rescaled per token to the conditional velocity's norm (`algorithms.cfg.true_cfg`). The Trajectory
  records each sample's negative embedding and guidance scale, so the recompute runs the same guidance.
- The initial noise, sigma grid (dynamic shift from the generated tokens only), SDE step and decode are the
  Qwen-Image engine's (the edit pipeline draws and decodes the same way).
- One `generate` call samples records whose sources share their patch grids (the Trajectory has one
  `cond_shapes`); the trainer's prompt batches are made of such records (the tiny task's are).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample
from model_providers.qwen_image_edit.conditioning import EditAreas, condition_grid
from model_providers.qwen_image_edit.data import EditRecord
from model_providers.qwen_image_edit.processor import load_processor


@dataclass(frozen=True)
class _Source:
    """One record's conditioning: text [L, D] fp32, packed source latents [S_c, C] fp32 (every source's tokens in
    the record's order), their patch grids, and the sources resized for the text encoder (PIL images, what a
    negative prompt is encoded with)."""

    text: torch.Tensor
    latents: torch.Tensor
    grids: tuple[tuple[int, int, int], ...]
    conditions: tuple


class EditRolloutEngine(DiffusersRolloutEngine):
    """Rollout with diffusers' Qwen-Image-Edit components (see the module docstring); the arguments are
    `DiffusersRolloutEngine`'s (`model_path`: a diffusers `QwenImageEditPlusPipeline` folder)."""

    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        from diffusers import QwenImageEditPlusPipeline

        self._edit_state(model_path)
        return QwenImageEditPlusPipeline.from_pretrained(model_path, processor=load_processor(model_path),
                                                         local_files_only=True, dtype=dtype)

    def _edit_state(self, model_path: str | os.PathLike) -> None:
        """The folder's resize areas and the empty per-record caches (the vLLM-Omni stepper calls it too)."""
        self.areas = EditAreas.of_folder(model_path)
        self._sources: OrderedDict[str, _Source] = OrderedDict()
        self._negatives: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()

    # ------------------------------------------------------------------ records
    @torch.no_grad()
    def source(self, prompt: str) -> _Source:
        """The conditioning of one edit prompt string (cached): what the pipeline's text encoder and VAE make of
        its source images and instruction."""
        if prompt in self._sources:
            self.stats["cache_hits"] += 1
            self._sources.move_to_end(prompt)
            return self._sources[prompt]
        self.stats["cache_misses"] += 1
        pipe = self.pipe
        record = EditRecord.parse(prompt)
        conditions, packed, grids = [], [], []
        for image in record.load_images():
            width, height = image.size
            cw, ch = self.areas.condition_size(width, height)
            vw, vh = self.areas.vae_size(width, height)
            conditions.append(pipe.image_processor.resize(image, ch, cw))
            pixels = pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2).to(self.device, pipe.vae.dtype)
            lat = pipe._encode_vae_image(pixels, generator=None)  # [1, z, 1, h, w], normalised
            packed.append(pipe._pack_latents(lat, 1, lat.shape[1], lat.shape[3], lat.shape[4])[0])
            grids.append(condition_grid(vw, vh, pipe.vae_scale_factor))
        text = self._text_embeds(record.instruction, conditions)
        entry = _Source(text=text, latents=torch.cat(packed).float().clone(), grids=tuple(grids),
                        conditions=tuple(conditions))
        self._sources[prompt] = entry
        while len(self._sources) > self.embed_cache_size:
            self._sources.popitem(last=False)
        return entry

    @torch.no_grad()
    def negative(self, prompt: str, negative_prompt: str) -> torch.Tensor:
        """The negative prompt's text embedding [L, D] fp32 for one edit record (cached): the pipeline encodes it
        with the record's source images, as it encodes the instruction."""
        key = (negative_prompt, prompt)
        if key in self._negatives:
            self._negatives.move_to_end(key)
            return self._negatives[key]
        entry = self._negatives[key] = self._text_embeds(negative_prompt, list(self.source(prompt).conditions))
        while len(self._negatives) > self.embed_cache_size:
            self._negatives.popitem(last=False)
        return entry

    def _text_embeds(self, text: str, conditions: list) -> torch.Tensor:
        """[L, D] fp32: the text encoder's embedding of `text` with the sources resized for it (PIL images), in the
        edit template ("Picture 1: ... <text>"), as the pipeline's `_get_qwen_prompt_embeds` makes it."""
        out, _ = self.pipe._get_qwen_prompt_embeds(prompt=[text], image=conditions, device=self.device,
                                                   dtype=self.dtype)
        return out[0].float().clone()

    def _negative_texts(self, prompts: list[str], params: SamplingParams) -> list[torch.Tensor]:
        return [self.negative(p, params.negative_prompt) for p in prompts]

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._sources.clear()
        self._negatives.clear()

    def encode_prompts(self, prompts: Sequence[str], max_length: int | None = None) -> list[torch.Tensor]:
        """Text embeddings [L_i, D] fp32 of each edit prompt (instruction and source image, see `source`)."""
        return [self.source(p).text for p in prompts]

    def text_lengths(self, prompts: Sequence[str]) -> list[int]:
        return [self.source(p).text.shape[0] for p in prompts]

    def encode_token_ids(self, keys):
        raise NotImplementedError("the edit engine encodes records (image + instruction), not token ids")

    # ------------------------------------------------------------------ samples
    def _new_sample(self, index: int, prompt: str, group_id: int, seed: int, params: SamplingParams, text, neg_text,
                    text_length: int | None = None) -> _Sample:
        sample = super()._new_sample(index, prompt, group_id, seed, params, text, neg_text, text_length)
        src = self.source(prompt)
        sample.cond_latents = src.latents.to(self.device)
        sample.cond_shapes = src.grids
        return sample
