"""`VllmOmniRolloutEngine`: FlowGRPO rollout in vLLM-Omni (GPU production engine).

vLLM-Omni's `Omni` serves the Qwen-Image folder with OUR pipeline class (`custom_pipeline_args`, see
`vllm_omni_pipeline`: the embedded engine's SDE stepping on vLLM-Omni's tensor-parallel transformer) and
OUR worker extension (`worker_extension_cls`, see `vllm_omni_worker`), which receives weights through
`collective_rpc`. One request is one sample; each returns its trajectory record, stacked here into the
same `Trajectory` the embedded engine returns.

vLLM and vLLM-Omni are imported when an engine is built, so `megatron_omni.rollout` imports without them.
vLLM-Omni has no CPU platform: this engine needs a GPU (tests on CPU drive the pipeline class and the
weight receiver directly).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_omni.rollout.base import FinishedSample, SamplingParams, Trajectory, sample_seeds
from megatron_omni.rollout.vllm_omni_pipeline import (
    EXTRA_KEY,
    PIPELINE_CLASS,
    record_to_trajectory,
    sample_prompt,
    sampling_extra,
)
from megatron_omni.rollout.vllm_omni_worker import WORKER_EXTENSION

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def omni_kwargs(model_path: str | os.PathLike, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                **extra: Any) -> dict[str, Any]:
    """The `Omni(...)` keywords that register our pipeline and worker extension (extra ones pass through)."""
    return {
        "model": str(model_path),
        "custom_pipeline_args": {"pipeline_class": PIPELINE_CLASS},
        "worker_extension_cls": WORKER_EXTENSION,
        "tensor_parallel_size": int(tensor_parallel_size),
        "dtype": dtype,
        **extra,
    }


class VllmOmniRolloutEngine:
    """A `RolloutEngine` backed by vLLM-Omni.

    Args:
        model_path: a diffusers Qwen-Image folder.
        tensor_parallel_size: vLLM-Omni's rollout tp.
        dtype: vLLM-Omni's model dtype (the SDE math is fp32 regardless).
        bucket_bytes: largest weight bucket `load_weights` sends in one `collective_rpc`.
        omni: an already started `Omni` with our pipeline and extension (then the other args are unused).
        **omni_extra: more `Omni(...)` keywords (e.g. `max_num_seqs`, `enable_sleep_mode`).
    """

    def __init__(self, model_path: str | os.PathLike, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, omni: Any = None, **omni_extra: Any) -> None:
        if omni is None:
            if not os.path.isdir(model_path):
                raise FileNotFoundError(f"no diffusers pipeline folder at {model_path}")
            from vllm_omni import Omni

            omni = Omni(**omni_kwargs(model_path, tensor_parallel_size, dtype, **omni_extra))
        self.omni = omni
        self.bucket_bytes = bucket_bytes
        self._asleep = False

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        group_size: int = 1,
        seeds: Sequence[int] | None = None,
        on_sample: Callable[[FinishedSample], None] | None = None,
    ) -> Trajectory:
        """See `RolloutEngine.generate`: row p * group_size + k is sample k of prompt p, seed `seeds[row]`."""
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if self._asleep:
            raise RuntimeError("engine is asleep; call wake_up() first")
        seeds = sample_seeds(len(prompts), group_size, seeds)
        n = len(seeds)
        requests = [sample_prompt(prompts[p], seeds[p * group_size + k], p * group_size + k, p)
                    for p in range(len(prompts)) for k in range(group_size)]
        sampling = OmniDiffusionSamplingParams(
            height=params.height, width=params.width, num_inference_steps=params.num_steps,
            extra_args={EXTRA_KEY: sampling_extra(params)},
        )
        records = []
        for out in self.omni.generate(requests, sampling, py_generator=True, use_tqdm=False):
            record = record_of(out, PIPELINE_CLASS)
            records.append(record)
            if on_sample is not None:
                on_sample(FinishedSample(record["index"], record["prompt"], record["group_id"], record["seed"],
                                         record["image"]))
        if len(records) != n:
            raise RuntimeError(f"vLLM-Omni returned {len(records)} samples for {n} requests")
        return record_to_trajectory(records, params)

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """A COMPLETE update of diffusers-named transformer tensors (full shapes); see `send_weight_update`."""
        return send_weight_update(self.omni.engine.collective_rpc, named_tensors, self.bucket_bytes)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        return self.omni.engine.collective_rpc(method, args=args)

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Release device memory (vLLM-Omni's worker sleep: weights offloaded, level 1)."""
        self._rpc("sleep", 1)
        self._asleep = True

    def wake_up(self) -> None:
        self._rpc("wake_up", None)
        self._asleep = False

    def close(self) -> None:
        """Shut the vLLM-Omni engine down."""
        self.omni.close()


def send_weight_update(rpc: Callable[..., list[Any]], named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[str]:
    """Send a complete weight update to every vLLM-Omni worker through `rpc` (`collective_rpc(method, args=...)`)
    and our worker extension: begin, buckets of at most `bucket_bytes`, finish (each worker checks names and
    shapes and refuses a partial update). Returns the names sent (without `transformer.`)."""
    names: list[str] = []
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    rpc("begin_weight_update", args=())
    for name, t in named_tensors:
        t = t.detach().cpu().contiguous()
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            rpc("load_weight_bucket", args=(bucket,))
            bucket, size = [], 0
        bucket.append((name, t))
        names.append(name.removeprefix("transformer."))
        size += t.numel() * t.element_size()
    if bucket:
        rpc("load_weight_bucket", args=(bucket,))
    rpc("finish_weight_update", args=())
    return names


def record_of(out: Any, pipeline_class: str) -> dict[str, Any]:
    """The trajectory record our pipeline (`pipeline_class`) put in a vLLM-Omni request output; raises on a
    failed request or an output without a record."""
    if getattr(out, "error", None):
        raise RuntimeError(f"vLLM-Omni request failed: {out.error}")
    record = getattr(out, "trajectory_latents", None)
    if not isinstance(record, dict) or "index" not in record:
        raise RuntimeError("vLLM-Omni output carries no FlowGRPO trajectory record: is the engine running "
                           f"{pipeline_class}?")
    return record
