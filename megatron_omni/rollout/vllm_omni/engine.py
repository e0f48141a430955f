"""`VllmOmniRolloutEngine`: FlowGRPO rollout in vLLM-Omni (`rollout.engine=vllm_omni`).

vLLM-Omni serves the Qwen-Image folder with OUR pipeline class (`custom_pipeline_args`, see
`vllm_omni.pipeline`: the embedded engine's SDE stepping on vLLM-Omni's tensor-parallel transformer) and
OUR worker extension (`worker_extension_cls`, see `vllm_omni.worker`), which receives weights through
`collective_rpc`. One request is one sample; each returns its trajectory record, stacked here into the
same `Trajectory` the embedded engine returns.

Two ways to run it, chosen by configuration (`rollout.vllm_omni_process`), behind one class:
- "engine" (the default, on every machine): vLLM-Omni's `Omni` engine with its own worker processes: the first
  trainer rank of each group of `rollout.tp` consecutive ranks owns one, its workers on the group's GPUs
  (colocated with the trainer, put to sleep while it trains), on CPU through our platform plugin
  (`vllm_omni.platform`); the other ranks of the group send it their requests. Weights go through the
  worker extension's bucket RPCs (the bridge's `full` mode), each worker checking the update was complete. The
  executor is `mp` at every tp (`executor_backend`): vLLM-Omni's `uni` executor (its default for one device)
  builds its worker in the caller's process, where its one-rank distributed initialisation meets the trainer
  rank's own process group (it skips `init_process_group`, then sizes its world group by the trainer's world,
  and its shutdown calls `torch.distributed.destroy_process_group()`, the trainer's);
- "inline": vLLM-Omni's real pipeline class and transformer in the trainer's own ranks (`vllm_omni.inline`),
  its tensor-parallel groups over the job's ranks: every rank of a rollout group runs the same forward on its
  shard, and the bridge writes the live parameters (`direct` mode at rollout tp = trainer tp).

Across the ranks of a rollout group, `generate` is collective (`collective = True`): each rank passes its
own share, the engine runs the union and each rank gets its own rows back.

vLLM and vLLM-Omni are imported when an engine is built, so `megatron_omni.rollout` imports without them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.parallel import platform
from megatron_omni.rollout.base import FinishedSample, SamplingParams, Trajectory, WeightSink, sample_seeds
from megatron_omni.rollout.diffusers_engines.engine import templated_token_ids
from megatron_omni.rollout.quantization import QuantizationSpec
from megatron_omni.rollout.vllm_omni.faults import (
    EngineStartError,
    EngineWorkerDied,
    dead_workers,
    root_cause,
    shared_by_owner,
    worker_died_message,
    worker_processes,
)
from megatron_omni.rollout.vllm_omni.fp8 import vllm_quantization_config
from megatron_omni.rollout.vllm_omni.pipeline import (
    EXTRA_KEY,
    PIPELINE_CLASS,
    pipeline_args,
    record_to_trajectory,
    sample_prompt,
    sampling_extra,
)
from megatron_omni.rollout.vllm_omni.worker import WORKER_EXTENSION

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
# After a failed call, how long to look for a worker's death before calling the failure something else: a surviving
# worker can report its peer's reset connection (failing the call) before the killed worker has exited.
WORKER_EXIT_SETTLE_S = 3.0
# Our pipeline class for a folder whose model_index.json names another pipeline than Qwen-Image's (default
# `PIPELINE_CLASS`), and the `module:function(folder, prompts) -> [int]` that counts a prompt's text tokens for it.
PIPELINE_CLASSES = {
    "WanPipeline": ("megatron_omni.rollout.vllm_omni.wan_pipeline.FlowGRPOWanPipeline",
                    "megatron_omni.rollout.vllm_omni.wan_pipeline:text_lengths"),
    "StableDiffusion3Pipeline": ("megatron_omni.rollout.vllm_omni.image_pipelines.FlowGRPOSD3Pipeline",
                                 "megatron_omni.rollout.vllm_omni.image_pipelines:sd3_text_lengths"),
    "FluxPipeline": ("megatron_omni.rollout.vllm_omni.image_pipelines.FlowGRPOFluxPipeline",
                     "megatron_omni.rollout.vllm_omni.image_pipelines:flux_text_lengths"),
    "QwenImageEditPlusPipeline": ("megatron_omni.rollout.vllm_omni.edit_pipeline.FlowGRPOQwenImageEditPipeline",
                                  "megatron_omni.rollout.vllm_omni.edit_pipeline:text_lengths"),
}


def pipeline_class_of(folder: str | os.PathLike) -> tuple[str, str | None]:
    """(our pipeline class, its text-length counter or None) for the diffusers folder (see `PIPELINE_CLASSES`)."""
    index = Path(folder) / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    return PIPELINE_CLASSES.get(name, (PIPELINE_CLASS, None))


def omni_kwargs(model_path: str | os.PathLike, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                quantization_config: dict[str, str] | None = None, pipeline_class: str = PIPELINE_CLASS,
                vae_dtype: torch.dtype | None = None, **extra: Any) -> dict[str, Any]:
    """The `Omni(...)` keywords that register our pipeline and worker extension (and vLLM-Omni's
    `quantization_config` when given; `vae_dtype`, what our pipeline casts its VAE to, rides in
    `custom_pipeline_args`, the one thing a worker's pipeline class is handed besides the config; extra ones pass
    through). A pipeline module may name per-stage overrides of vLLM-Omni's bundled deploy config for this tp (its
    `stage_overrides(tp)`: Wan's pins its stage to one device)."""
    module = pipeline_class.rpartition(".")[0]
    overrides = getattr(importlib.import_module(module), "stage_overrides", lambda _: None)(int(tensor_parallel_size))
    if overrides and "stage_overrides" not in extra:
        extra = {**extra, "stage_overrides": overrides}
    return {
        "model": str(model_path),
        "custom_pipeline_args": pipeline_args(pipeline_class, vae_dtype),
        "worker_extension_cls": WORKER_EXTENSION,
        "tensor_parallel_size": int(tensor_parallel_size),
        "dtype": dtype,
        **({} if quantization_config is None else {"quantization_config": quantization_config}),
        **extra,
    }


@dataclass(frozen=True)
class RolloutPeers:
    """The trainer ranks that share one engine: `group` (a process group of exactly them), their global `ranks`
    (`ranks[0]` owns a multi-process engine), `spmd`: every one of them runs the engine's forward on its own
    shard (in process), else only `ranks[0]` does and sends the others their rows."""

    group: Any
    ranks: tuple[int, ...]
    spmd: bool


class VllmOmniRolloutEngine:
    """A `RolloutEngine` backed by vLLM-Omni.

    Args:
        model_path: a diffusers Qwen-Image folder.
        tensor_parallel_size: vLLM-Omni's rollout tp.
        dtype: vLLM-Omni's model dtype (the SDE math is fp32 regardless): a torch dtype or its name.
        bucket_bytes: largest weight bucket `load_weights` sends in one `collective_rpc`.
        omni: an already started `Omni` (or `vllm_omni.inline.InProcessOmni`) with our pipeline and extension
            (then the other `Omni` args are unused); None with `peers` on a rank that owns no engine.
        peers: the ranks sharing this engine's calls (None: this rank alone).
        quantization: what the transformer runs quantized: vLLM-Omni's FP8 linears, fed FP8 weights at every sync
            (`rollout/vllm_omni/fp8.py`); a given `omni` must have been built with `vllm_quantization_config` of it.
            Call `load_initial_weights()` once before the first rollout (the builder does).
        **omni_extra: more `Omni(...)` keywords (e.g. `max_num_seqs`, `enable_sleep_mode`).
    """

    def __init__(self, model_path: str | os.PathLike, tensor_parallel_size: int = 1,
                 dtype: str | torch.dtype = "bfloat16", bucket_bytes: int = DEFAULT_BUCKET_BYTES, omni: Any = None,
                 peers: RolloutPeers | None = None, quantization: QuantizationSpec | None = None,
                 **omni_extra: Any) -> None:
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"no diffusers pipeline folder at {model_path}")
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        self.quantization = quantization or QuantizationSpec()
        self.pipeline_class, self._text_counter = pipeline_class_of(model_path)
        if omni is None and (peers is None or peers.spmd or dist.get_rank() == peers.ranks[0]):
            from vllm_omni import Omni

            omni = Omni(**omni_kwargs(model_path, tensor_parallel_size, str(self.dtype).removeprefix("torch."),
                                      quantization_config=vllm_quantization_config(self.quantization),
                                      pipeline_class=self.pipeline_class, **omni_extra))
        self.model_path = Path(model_path)
        self.tp = int(tensor_parallel_size)
        self.omni = omni
        self.peers = peers if peers is not None and len(peers.ranks) > 1 else None
        self.collective = self.peers is not None
        self.bucket_bytes = bucket_bytes
        self._asleep = False
        self._tokenizer_pipe = None  # diffusers' template + the folder's tokenizer, for text_lengths
        self._lora_request = None  # the LoRARequest of the adapters `load_lora` loaded
        # Faults (`vllm_omni.faults`): the worker processes, taken now (vLLM-Omni forgets an evicted executor); the
        # training step the trainer is in (named in a fault report); a worker death found by a call that must not
        # raise alone (sleep, wake, a weight update's RPCs), raised at the next point every peer passes.
        self._workers = [] if omni is None or self.in_process else worker_processes(omni)
        self.step: int | None = None
        self._failure: str | None = None
        self._defer = False
        self._phase = ""  # what the engine is in, for the fault report ("a weight update, ")

    def text_lengths(self, prompts: Sequence[str]) -> list[int]:
        """Text tokens each prompt gives the transformer (see `RolloutEngine.text_lengths`): counted with the
        folder's tokenizer and diffusers' own prompt template (our pipeline class encodes as diffusers does),
        on every rank, whether or not it owns the engine (another family's folder: its `PIPELINE_CLASSES` counter)."""
        if self._text_counter is not None:
            module, _, name = self._text_counter.partition(":")
            return getattr(importlib.import_module(module), name)(self.model_path, prompts)
        if self._tokenizer_pipe is None:
            from diffusers import QwenImagePipeline
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path / "tokenizer", local_files_only=True)
            self._tokenizer_pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None,
                                                     tokenizer=tokenizer, transformer=None)
        drop = self._tokenizer_pipe.prompt_template_encode_start_idx
        return [len(templated_token_ids(self._tokenizer_pipe, p)) - drop for p in prompts]

    @property
    def in_process(self) -> bool:
        """Whether the pipeline runs in this process (`vllm_omni.inline.InProcessOmni`)."""
        return hasattr(self.omni, "worker")

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        group_size: int = 1,
        seeds: Sequence[int] | None = None,
        on_sample: Callable[[FinishedSample], None] | None = None,
    ) -> Trajectory | None:
        """See `RolloutEngine.generate`: row p * group_size + k is sample k of prompt p, seed `seeds[row]`.
        With peers, collective: their shares run together; an empty share returns None."""
        if self._asleep:
            raise RuntimeError("engine is asleep; call wake_up() first")
        if params.guidance_scale_2 is not None:  # vLLM-Omni's engine serves no two-expert (A14B) folder here
            raise ValueError(f"guidance_scale_2={params.guidance_scale_2} guides a Wan2.2 A14B low-noise expert, "
                             "which the vLLM-Omni engine does not serve: sample that folder with the diffusers engine")
        if self.peers is None or prompts:
            seeds = sample_seeds(len(prompts), group_size, seeds)
        requests = [sample_prompt(prompts[p], seeds[p * group_size + k], p * group_size + k, p)
                    for p in range(len(prompts)) for k in range(group_size)]
        extra = sampling_extra(params)
        if self.peers is None:
            records = self._run(requests, params, extra,
                                None if on_sample is None else (lambda record: on_sample(_finished(record))))
        else:
            records = self._run_with_peers(requests, params, extra, on_sample)
        if len(records) != len(requests):
            raise RuntimeError(f"vLLM-Omni returned {len(records)} samples for {len(requests)} requests")
        return record_to_trajectory(records, params) if records else None

    def _run(self, requests: list[dict[str, Any]], params: SamplingParams, extra: dict[str, Any],
             on_record: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
        """Run `requests` through the engine; `on_record` sees each finished record."""
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        # With LoRA adapters loaded, every request names them: the worker activates each request's adapter (a
        # request without one would switch them off).
        sampling = OmniDiffusionSamplingParams(height=params.height, width=params.width,
                                               num_inference_steps=params.num_steps, extra_args={EXTRA_KEY: extra},
                                               lora_request=self._lora_request)
        records = []
        with self._guard("a rollout"):
            for out in self.omni.generate(requests, sampling, py_generator=True, use_tqdm=False):
                record = record_of(out, self.pipeline_class)
                records.append(record)
                if on_record is not None:
                    on_record(record)
        return records

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Around a call into the engine: a worker found dead (before, or by the call's failure) becomes
        `EngineWorkerDied` naming it, `what` and the step; any other failure passes through."""
        if self._failure is not None:
            raise EngineWorkerDied(self._failure)
        try:
            with guarded(self._workers, what, self.step):
                yield
        except EngineWorkerDied as exc:
            self._failure = str(exc)
            raise

    def _shared(self, compute: Callable[[], Any]) -> Any:
        """`compute()` on the owner (the others get its result over the peers' group); a failure on the owner is
        raised on every peer (a worker death as `EngineWorkerDied`), so none waits for an answer that never
        comes. Without peers, `compute()`."""
        if self.peers is None:
            return compute()
        owner = self.peers.ranks[0]

        def failure(died: bool, kind: str, message: str) -> Exception:
            if died:
                return EngineWorkerDied(message or kind)
            return RuntimeError(f"the vLLM-Omni engine's owner (rank {owner}) failed: {message or kind}")

        return shared_by_owner(compute, owner, self.peers.group, failure)

    def _run_with_peers(self, requests: list[dict[str, Any]], params: SamplingParams, extra: dict[str, Any],
                        on_sample: Callable[[FinishedSample], None] | None) -> list[dict[str, Any]]:
        """The union of every peer's requests, run once (by every peer in process, else by the owner); returns
        this rank's records with its own row indices."""
        peers = self.peers
        shares: list[Any] = [None] * len(peers.ranks)
        dist.all_gather_object(shares, (requests, extra), group=peers.group)
        asked = [e for reqs, e in shares if reqs]  # a rank with no requests only serves the others
        if any(e != asked[0] for e in asked):
            raise ValueError("the ranks sharing a vLLM-Omni engine asked for different sampling params in one call")
        extra = asked[0] if asked else extra
        me = peers.ranks.index(dist.get_rank())
        union, owner_of = [], {}
        for member, (reqs, _) in enumerate(shares):
            for r in reqs:
                info = dict(r["additional_information"][EXTRA_KEY])
                owner_of[len(union)] = (member, info["index"])
                info["index"] = len(union)
                union.append({**r, "additional_information": {EXTRA_KEY: info}})

        def mine(record: dict[str, Any]) -> dict[str, Any] | None:
            member, local = owner_of[record["index"]]
            return {**record, "index": local} if member == me else None

        def stream(record: dict[str, Any]) -> None:
            own = mine(record)
            if own is not None and on_sample is not None:
                on_sample(_finished(own))

        records = None
        params = SamplingParams(**{**extra["params"], "window_range": _tuple(extra["params"]["window_range"])})
        if peers.spmd:
            records = self._run(union, params, extra, stream) if union else None
        else:
            records = self._shared(lambda: self._run(union, params, extra, stream) if union else None)
            if me != 0 and on_sample is not None:
                for r in records or []:
                    stream(r)
        return [own for own in map(mine, records or []) if own is not None]

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """A COMPLETE update of diffusers-named transformer tensors (full shapes); see `send_weight_update`."""
        return send_weight_update(self._checked_rpc, named_tensors, self.bucket_bytes)

    def _checked_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self._rpc(method, *args)

    def load_lora(self, state: dict[str, torch.Tensor], rank: int,
                  alpha: float) -> tuple[Sequence[str], Sequence[str]]:
        """Receive LoRA adapters (diffusers peft keys, full tensors) into vLLM-Omni's transformer through its LoRA
        manager and layers (`vllm_omni.lora`: its LoRA request path the first time, in place after); returns
        (diffusers modules carrying the adapter, keys written), on every rank of the rollout group. In process
        each rank loads its own shard; multi-process the owner sends the adapters to its workers (worker
        extension `load_flowgrpo_lora_everywhere`: every worker's report, each checked against rollout rank 0's, which
        is returned) and the group's other ranks get it."""
        if self.in_process:
            report = self.omni.worker.load_flowgrpo_lora(state, rank, alpha)
            if self._lora_request is None:
                self._lora_request = self.omni.worker.flowgrpo_lora_request()
            return report
        return self._shared(lambda: self._deliver_lora(state, rank, alpha))

    def _deliver_lora(self, state: dict[str, torch.Tensor], rank: int, alpha: float) -> Any:
        """The owner's adapter delivery to every worker; returns rollout rank 0's report (see `load_lora`)."""
        cpu = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        reports = self._rpc("load_flowgrpo_lora_everywhere", cpu, rank, alpha)[0]
        if reports is None:  # deferred in a weight update: a worker died (raised at the update's end)
            return None
        if len(reports) != self.tp:
            raise RuntimeError(f"LoRA adapters: {len(reports)} of the engine's {self.tp} workers reported")
        for worker, report in enumerate(reports):
            carrying, written = report
            if tuple(carrying) != tuple(reports[0][0]) or list(written) != list(reports[0][1]):
                raise RuntimeError(f"LoRA adapters: vLLM-Omni worker {worker} carries {len(carrying)} modules and "
                                   f"wrote {len(written)} keys, worker 0 {len(reports[0][0])} and "
                                   f"{len(reports[0][1])}: the workers hold different adapters")
        if self._lora_request is None:
            self._lora_request = self._rpc("flowgrpo_lora_request")[0]
        return reports[0]

    def load_initial_weights(self) -> None:
        """A quantized engine's first weights: the folder's, quantized as every sync quantizes them (vLLM-Omni's
        own load put the folder's bf16 weights into its FP8 parameters without scales). Also checks that the
        weights vLLM-Omni quantizes are those the spec names. Nothing for an unquantized engine; every rank of a
        rollout group calls it."""
        if not self.quantization.enabled or self.omni is None:
            return
        from megatron_omni.rollout.vllm_omni.fp8 import check_quantized_names
        from megatron_omni.rollout.vllm_omni.image_pipelines import SD3_CONSTANTS
        from megatron_omni.rollout.vllm_omni.pipeline import diffusers_shapes

        names = self._rpc("quantized_weight_names")[0]
        index = json.loads((self.model_path / "model_index.json").read_text())
        model_class = (index.get("transformer") or [None, "QwenImageTransformer2DModel"])[1]
        check_quantized_names(names, self.quantization, diffusers_shapes(self.transformer_config(), model_class))
        # not SD3's sincos position table: a buffer both sides compute from the config, never sent
        self.load_weights((k, v) for k, v in self.initial_state_dict().items() if k not in SD3_CONSTANTS)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every worker; the replies of our one stage (`stage_replies`). A worker death raises
        `EngineWorkerDied`, except while deferred (sleep, wake, inside `weight_update`): then it is recorded, this
        and later RPCs answer [None], and the update's end (or the next call) raises it on every peer."""
        if self._defer and self._failure is not None:
            return [None]
        try:
            with self._guard(f"{self._phase}collective_rpc({method!r})"):
                return stage_replies(self.omni.engine.collective_rpc(method, args=args), method)
        except EngineWorkerDied:
            if self._defer:
                return [None]
            raise

    @contextlib.contextmanager
    def _deferred(self, phase: str = "") -> Iterator[None]:
        before = self._defer, self._phase
        self._defer, self._phase = True, phase
        try:
            yield
        finally:
            self._defer, self._phase = before

    def transformer_config(self) -> dict[str, Any]:
        """The diffusers config of the folder's transformer (`transformer/config.json`)."""
        return json.loads((self.model_path / "transformer" / "config.json").read_text())

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The folder's transformer tensors (what vLLM-Omni loaded), in the engine's dtype."""
        from safetensors.torch import load_file

        files = sorted((self.model_path / "transformer").glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files in {self.model_path / 'transformer'}")
        return {k: v.to(self.dtype) for f in files for k, v in load_file(str(f)).items()}

    def weight_sink(self) -> WeightSink:
        """In process: this rank's live vLLM-Omni transformer shard (direct mode possible). Multi-process: on
        the owner, the workers behind bucket RPCs (full mode; rollout rank 0's shapes for the coverage check,
        every worker checks its own update); on the other ranks nothing."""
        if self.in_process:
            # FP8: the checkpoint layout, loaded through the worker's receiver (quantized there), never in place
            return WeightSink(kind="vllm_omni", tp=self.tp, target=self.omni.worker.weight_target(),
                              in_place=not self.quantization.enabled)
        target = RpcTarget(self._rpc, self.tp) if self.omni is not None else None
        return WeightSink(kind="vllm_omni", tp=self.tp, target=target, in_place=False)

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """Multi-process, and an FP8 engine in process: begin / finish the workers' update around the sync (each
        worker raises on a partial one; FP8: one layer-wise reload). Otherwise, in process, the bridge writes
        the module and its coverage check covers it."""
        if self.in_process:
            if not self.quantization.enabled:
                yield
                return
            self._rpc("begin_weight_update")
            yield
            self._rpc("finish_weight_update")
            return
        # Multi-process: a worker death in the update is held until its end (every peer is there), then raised on
        # every rank of the group, the owner's message on each.
        error = None
        with self._deferred("a weight update, "):
            if self.omni is not None:
                self._rpc("begin_weight_update")
            try:
                yield
            except Exception as exc:  # noqa: BLE001 (re-raised below, after the peers learn of a death)
                error = exc
            if self.omni is not None and error is None:
                self._rpc("finish_weight_update")
        failure = self._failure
        if self.peers is not None:
            box = [failure]
            dist.broadcast_object_list(box, src=self.peers.ranks[0], group=self.peers.group)
            failure = box[0]
        if failure is not None:
            raise EngineWorkerDied(failure) from error
        if error is not None:
            raise error

    def probe(self, traj: Trajectory) -> torch.Tensor:
        """Transition means [N, W, S, C] of `traj` under vLLM-Omni's transformer (collective over the peers)."""
        from megatron_omni.algorithms.transition import recompute_log_probs

        if self.in_process:
            with torch.no_grad():
                return recompute_log_probs(traj, self.omni.pipeline.stepper.velocity_model, dtype=self.dtype,
                                           return_means=True).means
        return self._shared(lambda: self._rpc("probe_means", traj)[0])

    def requantize(self) -> None:
        """Nothing: the workers quantize every update as they load it (a live one, or an FP8 back copy at its swap,
        `back_buffer.QuantizedBackBuffer`); the asynchronous receiver calls it after each swap."""

    def probe_unquantized(self, traj: Trajectory) -> torch.Tensor | None:
        """`probe` for an unquantized engine; None for an FP8 one (it holds only FP8 weights)."""
        return None if self.quantization.enabled else self.probe(traj)

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Release device memory (vLLM-Omni's worker sleep: weights offloaded, level 1)."""
        if self.omni is not None:
            with self._deferred():  # a death found here is raised at the next call every peer makes
                self._rpc("sleep", 1)
        self._asleep = True

    def wake_up(self) -> None:
        if self.omni is not None:
            with self._deferred():
                self._rpc("wake_up", None)
        self._asleep = False

    def close(self) -> None:
        """Shut the vLLM-Omni engine down."""
        if self.omni is not None:
            self.omni.close()
            self.omni = None


class RpcTarget:
    """The bridge's view of a multi-process engine's workers from the rank that owns it: loads go to every
    worker as one bucket RPC (vLLM-Omni's loader takes each worker's slice and raises on anything it did not
    take); `parameters()` are rollout rank 0's shapes on the meta device, for the coverage check."""

    kind = "vllm_omni"
    tp_rank = 0

    def __init__(self, rpc: Callable[..., list[Any]], tp_size: int) -> None:
        self.rpc = rpc
        self.tp_size = tp_size
        shapes = rpc("parameter_shapes")[0]
        self._params = {n: torch.empty(s, device="meta") for n, s in shapes.items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._params

    def load_full(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        self.rpc("load_weight_bucket", [(n, t.detach().cpu().contiguous()) for n, t in items])
        return {n for n, _ in items}


@contextlib.contextmanager
def guarded(workers: Sequence[Any], what: str, step: int | None) -> Iterator[None]:
    """Around a call into an engine with worker processes `workers`: a failure while one of them is found dead
    becomes `EngineWorkerDied` naming it, `what` and the training `step`; any other failure passes through."""
    try:
        yield
    except Exception as exc:
        dead = dead_workers(workers, settle_s=WORKER_EXIT_SETTLE_S)
        if not dead:
            raise
        raise EngineWorkerDied(worker_died_message(dead, what, step)) from exc


def stage_replies(result: Any, method: str = "rpc") -> list[Any]:
    """The worker replies in what `Omni.engine.collective_rpc` returns: one entry per stage, a list of one reply per
    replying worker (`[[reply]]`); our engines have one stage. A worker's exception does NOT propagate through it:
    vLLM-Omni's stage pool logs it and puts `{"supported": False, "error": text}` in the stage's place, so that is
    raised here (RuntimeError naming the method and the worker's error). Under the `mp` executor every worker runs
    the method and rollout rank 0 replies after gathering each rank's status (a failure on any rank fails the
    call), so the list holds rank 0's reply; under `uni` the one worker's."""
    if isinstance(result, list) and len(result) == 1 and isinstance(result[0], dict) and "error" in result[0]:
        raise RuntimeError(f"vLLM-Omni worker failed in {method}: {result[0]['error']}")
    if not (isinstance(result, list) and len(result) == 1 and isinstance(result[0], list) and result[0]):
        raise RuntimeError(f"vLLM-Omni collective_rpc({method!r}) returned {type(result).__name__} {result!r:.120}, "
                           "not one stage's list of worker replies")
    return result[0]


def executor_backend() -> str:
    """The `distributed_executor_backend` an engine in a trainer rank takes: worker processes at every tp (see the
    module docstring); on the CPU platform our `mp` executor (`cpu_worker.CpuMultiprocExecutor`)."""
    from megatron_omni.rollout.vllm_omni.plugin import MP_EXECUTOR, accelerator_present

    return "mp" if accelerator_present() else MP_EXECUTOR


def _tuple(value: Any) -> Any:
    return None if value is None else tuple(value)


def _finished(record: dict[str, Any]) -> FinishedSample:
    return FinishedSample(record["index"], record["prompt"], record["group_id"], record["seed"], record["image"])


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


def build_vllm_omni_engine(pipeline_dir: str | os.PathLike, settings: Any) -> VllmOmniRolloutEngine:
    """The registry's builder (`rollout.engine=vllm_omni`), collective over the job: rollout groups of
    `settings.tp` consecutive ranks (vLLM-Omni's own tensor-parallel grouping). `settings.vllm_omni_process`
    "engine": one `Omni` engine per group, owned by its first rank, with worker processes (`executor_backend`) on
    the group's GPUs (or the host), sleep mode on (the trainer sleeps it while it trains); "inline": vLLM-Omni's
    pipeline in the trainer's ranks. An engine that fails to start raises one line naming the folder and cause,
    on every rank of its group (the others would wait for it)."""
    tp, world, rank = settings.tp, dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"rollout tp={tp} does not divide the world size {world}")
    process = getattr(settings, "vllm_omni_process", "engine")
    if process == "inline":
        from vllm.distributed import get_tp_group

        from megatron_omni.rollout.vllm_omni.inline import open_in_process_omni

        omni = open_in_process_omni(pipeline_dir, tp, settings.dtype, settings.max_batch_size,
                                    pipeline_class_of(pipeline_dir)[0], vllm_quantization_config(settings.quantization),
                                    vae_dtype=getattr(settings, "vae_dtype", None))
        group = get_tp_group()
        peers = RolloutPeers(group.cpu_group, tuple(group.ranks), spmd=True)
        engine = VllmOmniRolloutEngine(pipeline_dir, tp, settings.dtype, omni=omni, peers=peers,
                                       quantization=settings.quantization)
        engine.load_initial_weights()
        return engine
    if process != "engine":
        raise ValueError(f"rollout.vllm_omni_process must be 'engine' or 'inline', got {process!r}")
    peers = None
    for first in range(0, world, tp):  # every rank creates every group, in the same order
        ranks = tuple(range(first, first + tp))
        group = dist.new_group(list(ranks))
        if rank in ranks:
            peers = RolloutPeers(group, ranks, spmd=False)
    omni, failure = None, None
    if rank == peers.ranks[0]:
        try:
            omni = start_omni(pipeline_dir, tp, settings, pipeline_class_of(pipeline_dir)[0])
        except Exception as exc:  # every rank of the group raises it below, not only the owner
            failure = f"vLLM-Omni engine for {pipeline_dir} failed to start: {root_cause(exc)}"
    box = [failure]
    dist.broadcast_object_list(box, src=peers.ranks[0], group=peers.group)
    if box[0] is not None:
        raise EngineStartError(box[0])
    engine = VllmOmniRolloutEngine(pipeline_dir, tp, settings.dtype, omni=omni, peers=peers,
                                   quantization=settings.quantization)
    if engine._workers:  # what a fault report names, and what an operator looks for in `ps`
        print(f"vLLM-Omni engine of trainer ranks {list(peers.ranks)}: worker processes (rank: pid) "
              f"{ {r: p.pid for r, p in enumerate(engine._workers)} }", flush=True)
    engine.load_initial_weights()
    return engine


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    """`names` unset inside (the worker processes spawned inside inherit that). MASTER_PORT: vLLM-Omni takes its
    workers' rendezvous port from it when set: in a trainer rank that is the trainer's own port, so every engine
    owner of a node would settle on the same next free port at once (EADDRINUSE); without it each engine takes an
    OS-assigned port. TORCHELASTIC_USE_AGENT_STORE: torchrun sets it for its ranks, and torch's env:// rendezvous
    then makes EVERY rank a client of a store it assumes torchrun's agent hosts at MASTER_ADDR:MASTER_PORT; the
    workers' rendezvous at their own port then has no host and their `init_process_group` waits out its timeout
    (the engine never started under torchrun: what stalled the rollout-tp-2 run with eval.prompts)."""
    before = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(before)


def start_omni(pipeline_dir: str | os.PathLike, tp: int, settings: Any, pipeline_class: str = PIPELINE_CLASS) -> Any:
    """vLLM-Omni's `Omni` over `pipeline_dir` with `pipeline_class` (ours) and our worker extension, `tp` workers of
    `executor_backend()`, sleep mode on, on this node's GPUs from LOCAL_RANK (or the host). What a worker would only
    find after it spawned (no model_index.json, no transformer weights, a pipeline class that does not import) is
    checked first, here, so the error names it (a worker's start-up failure reaches the caller without its cause)."""
    folder = Path(pipeline_dir)
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"no diffusers pipeline (model_index.json) in {pipeline_dir}")
    if not sorted((folder / "transformer").glob("*.safetensors")):
        raise FileNotFoundError(f"no transformer weights (*.safetensors) in {folder / 'transformer'}")
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

    install_import_shims()
    module, _, name = pipeline_class.rpartition(".")
    try:
        # what the class's constructor would refuse in a worker (e.g. the Wan class's `check_folder`), refused here
        getattr(importlib.import_module(module), "check_folder", lambda _: None)(folder)
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"pipeline class {pipeline_class} does not import: {exc}") from None
    return start_engine(omni_kwargs(pipeline_dir, tp, str(settings.dtype).removeprefix("torch."),
                                    pipeline_class=pipeline_class, enable_sleep_mode=True,
                                    vae_dtype=getattr(settings, "vae_dtype", None),
                                    distributed_executor_backend=executor_backend(),
                                    quantization_config=vllm_quantization_config(settings.quantization)), tp)


def start_engine(kwargs: dict[str, Any], tp: int) -> Any:
    """`Omni(**kwargs)` with its `tp` workers on this node's devices from LOCAL_RANK (or the host), outside the
    trainer's rendezvous variables (`_without_env`), our import shims installed."""
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

    install_import_shims()
    from vllm_omni import Omni

    local = int(os.environ.get("LOCAL_RANK", "0"))
    workers_env = _without_env("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
    with platform.devices_for_workers(range(local, local + tp)), workers_env:
        return Omni(**kwargs)
