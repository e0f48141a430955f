"""The AR-DiT's DiT half served by vLLM-Omni: `FlowGRPOHybridDiTPipeline`, a vLLM-Omni pipeline class, and
`VllmOmniHybridDiT`, its client (`ARDiTRolloutEngine(dit_server=...)`).

The pipeline holds only vLLM-Omni 0.30.0's tensor-parallel `QwenImageTransformer2DModel`: the hybrid has no
text encoder (it conditions on its decoder's hidden states through the connector) and no VAE (it draws in
pixel space). It is served from the AR-DiT Hugging Face folder (`tools/checkpoint/convert_ar_dit.py`:
`decoder/`, `connector/`, `transformer/`) once `write_model_index` has put a `model_index.json` naming this
class beside them; vLLM serves the `decoder/` subfolder of the same folder (`VLLMPlanWriter`).

One vLLM-Omni request is one sample: its `prompt_embeds` [L_i, D] are the connector output of its prompt + plan
(unpadded), its `additional_information[HYBRID_KEY]` holds its row index and its torch generator's state after
the plan (`Generator.get_state()`); the call's `extra_args[HYBRID_KEY]` carries `ARDiTSamplingParams`. The
pipeline restores the generators and runs `diffusers_engines.ar_dit.denoise_window`, the embedded engine's loop, so the
served trajectory equals the embedded one for the same weights (up to float rounding: masked text padding and
batching). Each request's `DiffusionOutput` carries the image in [-1, 1] and, in `trajectory_latents`, the
sample's record. Weights arrive through the same worker extension as the Qwen-Image pipeline's
(`vllm_omni.worker`: bucketed full diffusers-named tensors, names and shapes checked, partial updates refused).

vLLM-Omni is imported lazily (module `__getattr__`), so importing this module needs neither vllm nor vllm_omni.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_omni.algorithms.schedule import qwen_image_sigmas
from megatron_omni.algorithms.velocity import pad_text
from megatron_omni.rollout.base import Trajectory
from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTSamplingParams, denoise_window
from megatron_omni.rollout.vllm_omni.engine import (
    DEFAULT_BUCKET_BYTES,
    omni_kwargs,
    record_of,
    send_weight_update,
    stage_replies,
)
from megatron_omni.rollout.vllm_omni.pipeline import (
    VllmOmniVelocity,
    check_full_weights,
    diffusers_shapes,
    lazy_classes,
    request_params,
    request_sample,
)

HYBRID_PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.hybrid.FlowGRPOHybridDiTPipeline"
HYBRID_KEY = "flowgrpo_hybrid"
RECORD_TENSORS = ("latents", "next_latents", "log_probs", "image")


def write_model_index(folder: str | os.PathLike) -> Path:
    """Make an AR-DiT Hugging Face folder servable by vLLM-Omni: `model_index.json` naming our pipeline class
    and the diffusers transformer in `transformer/` (written atomically; the folder must hold
    `transformer/config.json`). Returns the index's path."""
    root = Path(folder)
    if not (root / "transformer" / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no transformer/config.json: not an AR-DiT Hugging Face folder")
    index = {"_class_name": "FlowGRPOHybridDiTPipeline", "_diffusers_version": _diffusers_version(),
             "transformer": ["diffusers", "QwenImageTransformer2DModel"]}
    path = root / "model_index.json"
    tmp = root / ".model_index.json.partial"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


# ---------------------------------------------------------------------------------------------- requests


def hybrid_sampling_extra(params: ARDiTSamplingParams) -> dict[str, Any]:
    """What the call's `OmniDiffusionSamplingParams.extra_args[HYBRID_KEY]` carries (plain Python values)."""
    return {"params": dataclasses.asdict(params)}


def hybrid_request(prompt_embeds: torch.Tensor, generator_state: torch.Tensor, index: int) -> dict[str, Any]:
    """One sample's vLLM-Omni prompt: connector output [L_i, D] (no padding) and its generator's state."""
    if prompt_embeds.dim() != 2 or prompt_embeds.shape[0] == 0:
        raise ValueError(f"prompt_embeds must be [L, D] with L >= 1, got {tuple(prompt_embeds.shape)}")
    return {"prompt_embeds": prompt_embeds.detach().float().cpu().contiguous(),
            "additional_information": {HYBRID_KEY: {"index": int(index),
                                                    "generator_state": generator_state.clone()}}}


def parse_hybrid_request(prompt: Any, sampling: Any) -> tuple[torch.Tensor, ARDiTSamplingParams, int, torch.Tensor]:
    """(prompt_embeds [L, D], params, index, generator state) of one request; raises naming what is missing."""
    raw = request_params(sampling, HYBRID_KEY, "params", ("grid", "window_range"), "hybrid DiT pipeline",
                         "hybrid_sampling_extra()")
    if not isinstance(prompt, Mapping) or not isinstance(prompt.get("prompt_embeds"), torch.Tensor):
        raise ValueError("hybrid DiT pipeline: each prompt must be a dict with 'prompt_embeds' (the connector "
                         f"output), got {prompt!r:.80}")
    sample = request_sample(prompt, HYBRID_KEY, ("index", "generator_state"), "hybrid DiT pipeline",
                            "hybrid_request()")
    return prompt["prompt_embeds"], ARDiTSamplingParams(**raw), int(sample["index"]), sample["generator_state"]


def generators_from_states(states: Sequence[torch.Tensor]) -> list[torch.Generator]:
    """CPU generators restored from `Generator.get_state()` tensors."""
    gens = []
    for state in states:
        g = torch.Generator()
        g.set_state(state)
        gens.append(g)
    return gens


def serve_denoise(transformer: torch.nn.Module, requests: Sequence[tuple[torch.Tensor, int, torch.Tensor]],
                  params: ARDiTSamplingParams, channels: int, max_batch_size: int) -> list[dict[str, Any]]:
    """The pipeline's work on (prompt_embeds [L_i, D], index, generator state) requests: one record per
    request ({index, latents [W, S, C], next_latents, log_probs [W], window_start, image [3, H, W] in [0, 1]})."""
    device = next(transformer.parameters()).device
    dtype = next(transformer.parameters()).dtype
    cond, mask = pad_text([e.float() for e, _, _ in requests])
    traj = denoise_window(VllmOmniVelocity(transformer), cond.to(device), mask.to(device),
                          generators_from_states([s for _, _, s in requests]), params, channels, max_batch_size,
                          dtype=dtype)
    return [{"index": idx, "latents": traj.latents[r], "next_latents": traj.next_latents[r],
             "log_probs": traj.log_probs[r], "window_start": int(traj.window_start[r]), "image": traj.images[r]}
            for r, (_, idx, _) in enumerate(requests)]


# ---------------------------------------------------------------------------------------------- the client


class VllmOmniHybridDiT:
    """The DiT half of `ARDiTRolloutEngine` in a vLLM-Omni engine running `FlowGRPOHybridDiTPipeline`.

    Args:
        model_path: an AR-DiT Hugging Face folder with `model_index.json` (`write_model_index`).
        dit_config: the hybrid's diffusers DiT config (names and full shapes of the weight updates).
        tensor_parallel_size, dtype, bucket_bytes, **omni_extra: as `VllmOmniRolloutEngine`.
        omni: an already started `Omni` with our pipeline class and worker extension (any object with its
            `generate(requests, sampling, py_generator=..., use_tqdm=...)` and `engine.collective_rpc`).
    """

    def __init__(self, model_path: str | os.PathLike, dit_config: Mapping[str, Any], tensor_parallel_size: int = 1,
                 dtype: str = "bfloat16", bucket_bytes: int = DEFAULT_BUCKET_BYTES, omni: Any = None,
                 **omni_extra: Any) -> None:
        if omni is None:
            if not (Path(model_path) / "model_index.json").is_file():
                raise FileNotFoundError(f"{model_path} has no model_index.json: run write_model_index on the AR-DiT "
                                        "Hugging Face folder first")
            from vllm_omni import Omni

            kwargs = omni_kwargs(model_path, tensor_parallel_size, dtype, **omni_extra)
            kwargs["custom_pipeline_args"] = {"pipeline_class": HYBRID_PIPELINE_CLASS}
            omni = Omni(**kwargs)
        self.omni = omni
        self.full_shapes = diffusers_shapes(dit_config)
        self.bucket_bytes = bucket_bytes

    def denoise(self, cond: torch.Tensor, text_mask: torch.Tensor, generator_states: Sequence[torch.Tensor],
                params: ARDiTSamplingParams) -> Trajectory:
        """`diffusers_engines.ar_dit.denoise_window` served: cond [N, L, D], text_mask [N, L], N generator states."""
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        n = cond.shape[0]
        if text_mask.shape != cond.shape[:2] or len(generator_states) != n:
            raise ValueError(f"cond {tuple(cond.shape)}, text_mask {tuple(text_mask.shape)} and "
                             f"{len(generator_states)} generator states do not describe the same samples")
        lens = text_mask.long().sum(1)
        requests = [hybrid_request(cond[r, : int(lens[r])], generator_states[r], r) for r in range(n)]
        sampling = OmniDiffusionSamplingParams(num_inference_steps=params.num_steps,
                                               extra_args={HYBRID_KEY: hybrid_sampling_extra(params)})
        records = [record_of(out, HYBRID_PIPELINE_CLASS)
                   for out in self.omni.generate(requests, sampling, py_generator=True, use_tqdm=False)]
        return records_to_trajectory(records, cond, text_mask, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """A complete update of diffusers-named DiT tensors (full shapes), checked here before anything is sent
        and again by every worker (see `vllm_omni.worker.WeightReceiver`)."""
        items = check_full_weights(named_tensors, self.full_shapes)
        def rpc(method: str, args: tuple = ()) -> list:  # a worker's refusal raises (see stage_replies)
            return stage_replies(self.omni.engine.collective_rpc(method, args=args), method)

        return send_weight_update(rpc, items, self.bucket_bytes)

    def close(self) -> None:
        """Shut the vLLM-Omni engine down."""
        self.omni.close()


def records_to_trajectory(records: Sequence[Mapping[str, Any]], cond: torch.Tensor, text_mask: torch.Tensor,
                          params: ARDiTSamplingParams) -> Trajectory:
    """The served samples' records (any order) as the `Trajectory` `denoise_window` returns for cond [N, L, D]."""
    n = cond.shape[0]
    by_index = {int(r["index"]): r for r in records}
    if sorted(by_index) != list(range(n)):
        raise RuntimeError(f"vLLM-Omni returned records for rows {sorted(by_index)[:8]}... instead of 0..{n - 1}")
    recs = [by_index[i] for i in range(n)]
    for r in recs:
        bad = [k for k in RECORD_TENSORS if not isinstance(r.get(k), torch.Tensor)]
        if bad:
            raise ValueError(f"sample record {r['index']} lacks tensors {bad}")
    s_img = params.grid[1] * params.grid[2]
    sigmas = qwen_image_sigmas(params.num_steps, s_img)
    return Trajectory(
        prompts=[""] * n, group_ids=torch.zeros(n, dtype=torch.long), seeds=torch.zeros(n, dtype=torch.long),
        prompt_embeds=cond.float().cpu(), prompt_embeds_mask=text_mask.long().cpu(), negative_prompt_embeds=None,
        negative_prompt_embeds_mask=None, guidance_scale=torch.ones(n),
        latents=torch.stack([r["latents"] for r in recs]), next_latents=torch.stack([r["next_latents"] for r in recs]),
        log_probs=torch.stack([r["log_probs"] for r in recs]), sigmas=sigmas.expand(n, -1).clone(),
        window_start=torch.tensor([int(r["window_start"]) for r in recs], dtype=torch.long),
        images=torch.stack([r["image"] for r in recs]), img_shape=tuple(params.grid),
        noise_level=float(params.noise_level), sde_type=params.sde_type,
    )


# ---------------------------------------------------------------------------------------------- the class


def _build_pipeline_class() -> type:
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel
    from vllm_omni.diffusion.utils.tf_utils import get_transformer_config_kwargs

    class FlowGRPOHybridDiTPipeline(torch.nn.Module):
        """vLLM-Omni's Qwen-Image transformer alone, denoised by our pixel-space SDE window (module docstring)."""

        supports_step_execution = False

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            super().__init__()
            self.od_config = od_config
            self.weights_sources = [DiffusersPipelineLoader.ComponentSource(
                model_or_path=od_config.model, subfolder="transformer", revision=None, prefix="transformer.",
                fall_back_to_pt=True)]
            tf_config = od_config.tf_model_config
            kwargs = get_transformer_config_kwargs(tf_config, QwenImageTransformer2DModel)
            self.transformer = QwenImageTransformer2DModel(od_config=od_config,
                                                           quant_config=od_config.quantization_config, **kwargs)
            self.full_shapes = diffusers_shapes(tf_config.to_dict())
            self.channels = int(self.transformer.in_channels)
            self.max_batch_size = int(getattr(od_config, "max_batch_size", 0) or 8)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            """The folder's `transformer.`-prefixed diffusers tensors, checked (names, full shapes), through
            vLLM's `AutoWeightsLoader` (fused q/k/v, tp slices); returns vLLM-Omni's names of what it loaded."""
            items = check_full_weights(weights, self.full_shapes)
            return AutoWeightsLoader(self).load_weights((f"transformer.{n}", t) for n, t in items)

        @torch.no_grad()
        def forward(self, req: Any) -> list[Any]:
            """One sample per request; one DiffusionOutput per request, in request order."""
            parsed = [parse_hybrid_request(p, sp) for p, sp in zip(req.prompts, req.sampling_params_list)]
            params = parsed[0][1]
            if any(p != params for _, p, _, _ in parsed):
                raise ValueError("hybrid DiT pipeline: one batch must share its ARDiTSamplingParams")
            records = serve_denoise(self.transformer, [(e, i, s) for e, _, i, s in parsed], params, self.channels,
                                    self.max_batch_size)
            return [DiffusionOutput(output=r["image"][None] * 2 - 1, trajectory_latents=r,
                                    trajectory_log_probs=r["log_probs"][None]) for r in records]

    FlowGRPOHybridDiTPipeline.__module__ = __name__
    FlowGRPOHybridDiTPipeline.__qualname__ = "FlowGRPOHybridDiTPipeline"
    return FlowGRPOHybridDiTPipeline


__getattr__ = lazy_classes(__name__, {"FlowGRPOHybridDiTPipeline": _build_pipeline_class})
