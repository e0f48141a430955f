"""vLLM-Omni 0.30.0's real Qwen-Image pipeline and transformer in the trainer's own ranks, without vLLM-Omni's
engine and workers, its parallel state over the job's ranks: `rollout.vllm_omni_process=inline`
(`open_in_process_omni`; the bridge writes the live weights, `direct` mode at rollout tp = trainer tp), and the
tests of the bridge and of the pipeline class. The default is vLLM-Omni's own engine (`engine`).

vLLM-Omni's Wan2.2 transformer is built here too (`build_wan_transformer`), for the Wan family's bridge.

On CPU vLLM-Omni runs on our platform plugin (`vllm_omni.platform`: SDPA attention whose forward is
`_forward_impl`, the linear layers keeping their weights in place through `init_diffusion_model_runner_runtime`,
called here as a worker's runner calls it). What this path adds itself:
- torch.distributed (gloo) is up before vLLM-Omni's `init_distributed_environment` (the harness does it), whose
  world is then the job's;
- each linear layer's `process_weights_after_loading` runs on vLLM's unpacked CPU path (`finish_loading`), for
  modules built outside vLLM-Omni's loader.

vLLM-Omni's LoRA manager and layers (`vllm_omni.diffusion.lora`, over vLLM's `vllm.lora.layers`) need no patch:
the in-process worker builds the manager as `DiffusionWorker.init_lora_manager` does and `generate` activates each
call's `lora_request` as `DiffusionWorker.execute_model` does (`vllm_omni.lora`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.parallel import platform
from megatron_omni.rollout.vllm_omni.pipeline import pipeline_args


@contextlib.contextmanager
def vllm_omni_parallel(tp: int, model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                       quantization_config: Any = None) -> Iterator[tuple[Any, Any]]:
    """vLLM-Omni's parallel state at tensor-parallel size `tp` over the current torch.distributed job (for
    the diffusers folder `model`, in `dtype`, quantized by `quantization_config`, when given).

    Yields (od_config, vllm_config) inside vLLM-Omni's forward context; tears the model-parallel groups
    down on exit so the next test in the same rank process can build its own.
    """
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
    from vllm_omni.diffusion.distributed import parallel_state as ps
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    if not dist.is_initialized():
        raise RuntimeError("start torch.distributed (gloo) before vLLM-Omni's parallel state")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by rollout tp={tp}")
    parallel = DiffusionParallelConfig(tensor_parallel_size=tp, data_parallel_size=world // tp)
    if model is None:
        od = OmniDiffusionConfig(parallel_config=parallel)
    else:
        od = OmniDiffusionConfig(model=str(model), dtype=dtype, parallel_config=parallel,
                                 quantization_config=quantization_config)
        od.enrich_config()
    vc = create_diffusion_vllm_config(platform.device(), od)
    with set_forward_context(vllm_config=vc, omni_diffusion_config=od):
        os.environ.setdefault("LOCAL_RANK", str(rank))
        ps.init_distributed_environment(world_size=world, rank=rank, distributed_init_method="env://",
                                        local_rank=rank, backend=platform.backend())
        ps.initialize_model_parallel(tensor_parallel_size=tp, data_parallel_size=world // tp,
                                     backend=platform.backend())
        try:
            yield od, vc
        finally:
            ps.destroy_model_parallel()


def build_transformer(od_config: Any, hf_config: dict[str, Any]) -> torch.nn.Module:
    """vLLM-Omni's `QwenImageTransformer2DModel` for a diffusers config (call inside `vllm_omni_parallel`)."""
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(od_config, **hf_config).eval()


def build_wan_transformer(hf_config: dict[str, Any]) -> torch.nn.Module:
    """vLLM-Omni's Wan2.2 `WanTransformer3DModel` for a diffusers config (call inside `vllm_omni_parallel`).

    Its package's `__init__` imports the image-to-video pipeline, which imports torchvision (it does not install
    beside the CPU torch), so the package is entered without running its `__init__`: the transformer's own
    module is imported and built as it is."""
    from megatron_omni.rollout.vllm_omni.wan_pipeline import wan2_2_module

    module = wan2_2_module("wan2_2_transformer")
    kwargs = {k: v for k, v in hf_config.items() if k != "qk_norm"}  # vLLM-Omni's always normalises across heads
    return module.WanTransformer3DModel(**kwargs).eval()


def finish_loading(module: torch.nn.Module) -> None:
    """Run each linear layer's post-load hook on vLLM's unpacked CPU path (parameters stay in place). Besides
    vLLM's linear layers this covers every module that holds a linear method's weights (BAGEL's MoT linears keep
    the generation expert's in a plain `gen_exp` submodule sharing the layer's method, as vLLM's loader finds it)."""
    from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase

    for m in module.modules():
        if isinstance(m, LinearBase) or isinstance(getattr(m, "quant_method", None), LinearMethodBase):
            m.skip_weight_relayout = True
            m.quant_method.process_weights_after_loading(m)


@torch.no_grad()
def forward(module: torch.nn.Module, latents: torch.Tensor, prompt_embeds: torch.Tensor, prompt_mask: torch.Tensor,
            sigma: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """vLLM-Omni transformer output [b, s_img, p*p*out] for diffusers-layout inputs."""
    b = latents.shape[0]
    return module(hidden_states=latents, encoder_hidden_states=prompt_embeds, encoder_hidden_states_mask=prompt_mask,
                  timestep=sigma, img_shapes=[[grid]] * b,
                  txt_seq_lens=[int(n) for n in prompt_mask.sum(1)]).sample


def keep_linear_weights_in_place() -> None:
    """vLLM-Omni's pipeline loader runs the linear layers' post-load hook itself, so the unpacked-path flag
    (`finish_loading`) must be set inside it: the platform's runner hook does it (a worker's runner calls it
    before loading; so does this in-process path)."""
    from vllm_omni.platforms import current_omni_platform

    current_omni_platform.init_diffusion_model_runner_runtime(vllm_config=None, od_config=None,
                                                              device=platform.device())


@contextlib.contextmanager
def vllm_omni_model(model: str | os.PathLike, tp: int, pipeline_class: str, dtype: torch.dtype = torch.float32,
                    max_batch_size: int | None = None, quantization_config: Any = None,
                    vae_dtype: torch.dtype | None = None) -> Iterator[Any]:
    """vLLM-Omni's parallel state at tensor-parallel size `tp` and the pipeline class `pipeline_class` loaded
    from the diffusers folder `model` by vLLM-Omni's own loader (`load_format="custom_pipeline"`, the path
    `custom_pipeline_args` takes in a worker), in `dtype` on this process's device (`max_batch_size`: samples
    per transformer forward of our pipeline; `quantization_config`: vLLM-Omni's, e.g.
    `vllm_omni.fp8.vllm_quantization_config`; `vae_dtype`: what our pipeline casts its VAE to, None: `dtype`). Yields
    the pipeline inside the forward context."""
    keep_linear_weights_in_place()
    from vllm.config import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    with vllm_omni_parallel(tp, model, dtype, quantization_config) as (od, _):
        if max_batch_size is not None:
            od.max_batch_size = int(max_batch_size)  # read by our pipeline class's stepper
        od.custom_pipeline_args = pipeline_args(pipeline_class, vae_dtype)  # as a worker's config carries them
        loader = DiffusersPipelineLoader(LoadConfig(), od_config=od)
        yield loader.load_model(load_device=platform.device_type(), load_format="custom_pipeline",
                                custom_pipeline_name=pipeline_class)


def worker_with_extension(pipeline: Any) -> Any:
    """A worker holding `pipeline`, extended with ours the way vLLM-Omni's `WorkerWrapperBase` does it
    (`type(name, (extension, worker_class), {})`). vLLM-Omni's `DiffusionWorker` itself cannot be imported on
    CPU (its module chain imports torchvision, which does not install beside the CPU torch)."""
    from types import SimpleNamespace

    from megatron_omni.rollout.vllm_omni.worker import FlowGRPOWorkerExtension

    class Worker:
        def __init__(self) -> None:
            self.model_runner = SimpleNamespace(pipeline=pipeline)
            self.lora_manager = None

        # DiffusionWorker.init_lora_manager with its default (peft) backend; it builds the manager when the worker
        # starts, this one when the first adapter arrives (an engine without LoRA never builds one).
        def init_lora_manager(self) -> None:
            from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

            od = pipeline.od_config
            self.lora_manager = DiffusionLoRAManager(pipeline, device=torch.device(pipeline.device), dtype=od.dtype,
                                                     max_cached_adapters=od.max_cpu_loras or 1)

        # DiffusionWorker.add_lora
        def add_lora(self, lora_request: Any) -> bool:
            return False if self.lora_manager is None else self.lora_manager.add_adapter(lora_request)

        # vLLM-Omni's worker sleep releases CUDA memory through its allocator; in this process on CPU there is
        # no device memory to release (the engine still refuses to generate while asleep).
        def sleep(self, level: int = 1) -> None:
            pass

        def wake_up(self, tags: list[str] | None = None) -> None:
            pass

    return type("WorkerWithFlowGRPOWorkerExtension", (FlowGRPOWorkerExtension, Worker), {})()


class InProcessOmni:
    """The two `Omni` calls our clients make, served by a pipeline in this process (the multi-process engine
    needs a GPU platform): `generate` wraps each prompt in vLLM-Omni's `OmniDiffusionRequest`, one
    `DiffusionRequestBatch` per call, into the pipeline's `forward`; `engine.collective_rpc(method, args=...)`
    calls the method on a worker composed with our extension (`worker_with_extension`). Prompts, the sampling
    params' `extra_args` and the outputs' trajectory records cross vLLM-Omni's own msgpack wire format
    (`OmniMsgpackEncoder` / `OmniMsgpackDecoder`, what its stage processes use), so what does not survive
    serialisation fails here too."""

    def __init__(self, pipeline: Any, on_close: Any = None) -> None:
        from types import SimpleNamespace

        from vllm_omni.distributed.omni_connectors.utils.serialization import OmniMsgpackDecoder, OmniMsgpackEncoder

        self.pipeline = pipeline
        self.worker = worker_with_extension(pipeline)
        self.engine = SimpleNamespace(collective_rpc=self._collective_rpc)
        self.requests = 0
        self._encoder, self._decoder = OmniMsgpackEncoder(), OmniMsgpackDecoder()
        self._on_close = on_close

    def close(self) -> None:
        """What `Omni.close` is to the engine: here, leave vLLM-Omni's parallel state (`on_close`)."""
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def wire(self, obj: Any) -> Any:
        """`obj` after a trip through vLLM-Omni's msgpack serialisation."""
        return self._decoder.decode(self._encoder.encode(obj))

    def _collective_rpc(self, method: str, args: tuple = ()) -> list[list[Any]]:
        return [[getattr(self.worker, method)(*args)]]  # as `Omni.engine`'s: per stage, per worker

    def generate(self, prompts: list[Any], sampling: Any, py_generator: bool = True,
                 use_tqdm: bool = False) -> Iterator[Any]:
        import msgspec
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

        sampling = copy.copy(sampling)
        sampling.extra_args = self.wire(sampling.extra_args)
        if sampling.lora_request is not None:  # as vLLM-Omni's stage process receives it
            sampling.lora_request = msgspec.convert(self.wire(sampling.lora_request), type(sampling.lora_request))
        reqs = [OmniDiffusionRequest(prompt=self.wire(p), sampling_params=sampling, request_id=f"r{self.requests + i}")
                for i, p in enumerate(prompts)]
        self.requests += len(reqs)
        # DiffusionWorker.execute_model: the request's adapter (None: none) is made the active one first
        if self.worker.lora_manager is not None:
            self.worker.lora_manager.set_active_adapter(sampling.lora_request, sampling.lora_scale)
        for out in self.pipeline.forward(DiffusionRequestBatch(requests=reqs)):
            out.trajectory_latents = self.wire(out.trajectory_latents)
            yield out


def open_in_process_omni(model: str | os.PathLike, tp: int, dtype: torch.dtype, max_batch_size: int,
                         pipeline_class: str, quantization_config: Any = None,
                         vae_dtype: torch.dtype | None = None) -> InProcessOmni:
    """`vllm_omni_model` held open for an engine's lifetime: the `InProcessOmni` over the loaded pipeline, whose
    `close()` tears vLLM-Omni's parallel state and forward context down. Collective over the job (every rank
    joins vLLM-Omni's groups)."""
    stack = contextlib.ExitStack()
    try:
        pipeline = stack.enter_context(vllm_omni_model(model, tp, pipeline_class, dtype, max_batch_size,
                                                       quantization_config, vae_dtype))
    except BaseException:
        stack.close()
        raise
    return InProcessOmni(pipeline, on_close=stack.close)
