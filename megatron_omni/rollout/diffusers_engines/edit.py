"""The embedded rollout engine for image editing: `QwenImageEditPlusPipeline`'s components from a diffusers folder,
driven by the image engine's SDE step and continuous batching (`DiffusersRolloutEngine`, whose family hooks this
overrides), producing the same `Trajectory` plus the sources' latents.

- Prompts are edit records' prompt strings (`model_providers.qwen_image_edit.data.EditRecord.prompt`: the source
  image's path, the instruction, metadata); rewards receive the same strings.
- Per record, as the pipeline computes them (`model_providers.qwen_image_edit.conditioning`): the Qwen2.5-VL
  text encoder reads the source resized to the condition area plus the instruction in the edit template; the VAE
  encodes the source resized to the VAE area (`argmax` of the latent distribution: no sampling), normalised
  and packed. Both are cached by the prompt string (GRPO repeats each record G times).
- Every forward's image stream is `[latents | source tokens]` with `img_shapes = [[grid, source grid]]`; the
  velocity is the first `S` tokens'. The source tokens go into the Trajectory (`cond_latents`, `cond_shapes`)
  and the trainer's recompute appends those very tensors, so it sees what the rollout saw.
- The initial noise, sigma grid (dynamic shift from the generated tokens only), SDE step and decode are the
  Qwen-Image engine's (the edit pipeline draws and decodes the same way).
- Not supported yet: true CFG (the edit pipeline's negative prompt is encoded with each source image; refused
  here), and records of several source images (the model and its parity cover them; the data format has one).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_omni.rollout.base import FinishedSample, SamplingParams, Trajectory
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample
from model_providers.qwen_image_edit.conditioning import EditAreas, condition_grid
from model_providers.qwen_image_edit.data import EditRecord
from model_providers.qwen_image_edit.processor import load_processor


@dataclass(frozen=True)
class _Source:
    """One record's conditioning: text [L, D] fp32, packed source latents [S_c, C] fp32 and their patch grid."""

    text: torch.Tensor
    latents: torch.Tensor
    grid: tuple[int, int, int]


class EditRolloutEngine(DiffusersRolloutEngine):
    """Rollout with diffusers' Qwen-Image-Edit components (see the module docstring); the arguments are
    `DiffusersRolloutEngine`'s (`model_path`: a diffusers `QwenImageEditPlusPipeline` folder)."""

    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        from diffusers import QwenImageEditPlusPipeline

        self.areas = EditAreas.of_folder(model_path)
        self._sources: OrderedDict[str, _Source] = OrderedDict()
        return QwenImageEditPlusPipeline.from_pretrained(model_path, processor=load_processor(model_path),
                                                         local_files_only=True, dtype=dtype)

    # ------------------------------------------------------------------ records
    @torch.no_grad()
    def source(self, prompt: str) -> _Source:
        """The conditioning of one edit prompt string (cached): what the pipeline's text encoder and VAE make of
        its source image and instruction."""
        if prompt in self._sources:
            self.stats["cache_hits"] += 1
            self._sources.move_to_end(prompt)
            return self._sources[prompt]
        self.stats["cache_misses"] += 1
        pipe = self.pipe
        record = EditRecord.parse(prompt)
        image = record.load_image()
        width, height = image.size
        cw, ch = self.areas.condition_size(width, height)
        vw, vh = self.areas.vae_size(width, height)
        condition = pipe.image_processor.resize(image, ch, cw)
        text, _ = pipe._get_qwen_prompt_embeds(prompt=[record.instruction], image=[condition], device=self.device,
                                               dtype=self.dtype)
        pixels = pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2).to(self.device, self.dtype)
        lat = pipe._encode_vae_image(pixels, generator=None)  # [1, z, 1, h, w], normalised
        packed = pipe._pack_latents(lat, 1, lat.shape[1], lat.shape[3], lat.shape[4])[0]
        entry = _Source(text=text[0].float().clone(), latents=packed.float().clone(),
                        grid=condition_grid(vw, vh, pipe.vae_scale_factor))
        self._sources[prompt] = entry
        while len(self._sources) > self.embed_cache_size:
            self._sources.popitem(last=False)
        return entry

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._sources.clear()

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
        sample.cond_shapes = (src.grid,)
        return sample

    def generate(self, prompts: Sequence[str], params: SamplingParams, group_size: int = 1,
                 seeds: Sequence[int] | None = None,
                 on_sample: Callable[[FinishedSample], None] | None = None) -> Trajectory:
        """See `RolloutEngine.generate`; `prompts` are edit prompt strings. True CFG is refused (see the module
        docstring)."""
        if params.do_cfg:
            raise ValueError("the edit engine does not run true CFG yet (guidance_scale must be 1): the edit "
                             "pipeline encodes its negative prompt with each source image")
        return super().generate(prompts, params, group_size, seeds, on_sample)
