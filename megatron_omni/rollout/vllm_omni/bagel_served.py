"""BAGEL served by vLLM-Omni 0.30's own `Omni` engine in worker processes (`rollout.vllm_omni_process=engine`):
the worker-side pipeline class and the trainer-side client.

`ServedFlowGRPOBagelPipeline` is `FlowGRPOBagelPipeline` (vLLM-Omni's `BagelPipeline` with our SDE window,
`vllm_omni.bagel`) built as a vLLM-Omni worker builds a custom pipeline: `cls(od_config=...)` over a BAGEL folder
(its `config.json`, `llm_config.json`, `ema.safetensors`, `ae.safetensors`), under vLLM-Omni's own BAGEL deploy
topology `bagel_single_stage.yaml` (one diffusion stage that holds the whole MoT: BAGEL's other topology puts the
understanding expert in a separate AR stage, which text-to-image RL does not need). The FLUX autoencoder's sizes
ride in `custom_pipeline_args["bagel_ae"]` (a BAGEL folder stores its weights only; the stock pipeline assumes the
published 16-channel size). Each request is one sample: its prompt token ids, seed, row index and group id in
the prompt's `additional_information`, the call's `BagelSampling` in `extra_args`; its output carries the
sample's `BagelTrajectory` fields in `trajectory_latents`.

Weights reach the workers through our worker extension's bucketed update (`worker.WeightReceiver`, the pipeline's
`load_bucket`/`weight_shapes` hooks): full BAGEL-named tensors, each worker's vLLM loaders keeping its tp shard, every
tensor checked sent once. `ServedBagelPipeline` is the client a trainer rank holds: `generate` with the in-process
pipeline's signature and trajectory, `weight_target()` for the bridge (`engine.RpcTarget`), sleep, wake, close.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.rollout.vllm_omni.bagel import BagelSampling, BagelTrajectory
from megatron_omni.rollout.vllm_omni.pipeline import EXTRA_KEY, lazy_classes, request_params, request_sample

SERVED_BAGEL_PIPELINE_CLASS = "megatron_omni.rollout.vllm_omni.bagel_served.ServedFlowGRPOBagelPipeline"
DEPLOY_CONFIG = "bagel_single_stage.yaml"  # vLLM-Omni's BAGEL topology with one (diffusion) stage


def deploy_config_path() -> str:
    """vLLM-Omni's bundled `deploy/bagel_single_stage.yaml`."""
    import vllm_omni

    path = Path(vllm_omni.__file__).parent / "deploy" / DEPLOY_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"vLLM-Omni ships no {DEPLOY_CONFIG} (looked in {path.parent})")
    return str(path)


def check_folder(folder: str | os.PathLike) -> None:
    """What a worker would refuse about a BAGEL folder, checked before an engine starts: the published layout's
    files (`config.json` with `new_token_ids`, `llm_config.json`, `vit_config.json`, `ema.safetensors`,
    `ae.safetensors`)."""
    from model_providers.bagel.provider import read_bagel_config

    folder = Path(folder)
    read_bagel_config(folder)
    for name in ("ema.safetensors", "ae.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} is not a BAGEL folder: no {name}")


def sample_request(ids: torch.Tensor, seed: int, index: int, group_id: int) -> dict[str, Any]:
    """One sample's vLLM-Omni prompt: its token ids `[L]` (`[bos, text..., eos]`), seed, row index and group id."""
    return {"prompt": "", "additional_information": {EXTRA_KEY: {
        "prompt_ids": [int(i) for i in ids.tolist()], "seed": int(seed), "index": int(index),
        "group_id": int(group_id)}}}


def sampling_extra(sampling: BagelSampling) -> dict[str, Any]:
    """The call's `extra_args[EXTRA_KEY]`: the `BagelSampling` as plain values."""
    return {"bagel": dataclasses.asdict(sampling)}


def parse_request(prompt: Any, sp: Any) -> tuple[torch.Tensor, BagelSampling, int, int, int]:
    """(ids [L], sampling, seed, index, group_id) of one request; raises naming what is missing."""
    who = "BAGEL FlowGRPO pipeline"
    raw = request_params(sp, EXTRA_KEY, "bagel", ("window_range", "cfg_interval"), who, "bagel_served.sampling_extra")
    sample = request_sample(prompt, EXTRA_KEY, ("prompt_ids", "seed", "index", "group_id"), who,
                            "bagel_served.sample_request")
    return (torch.tensor(sample["prompt_ids"], dtype=torch.long), BagelSampling(**raw), int(sample["seed"]),
            int(sample["index"]), int(sample["group_id"]))


def trajectory_record(traj: BagelTrajectory, index: int) -> dict[str, Any]:
    """A one-sample trajectory as the dict a request returns (its fields, plus the row `index`)."""
    return {"index": index, **{f.name: getattr(traj, f.name) for f in dataclasses.fields(traj)}}


def concat_records(records: Sequence[dict[str, Any]]) -> BagelTrajectory:
    """One-sample records (any order) as the call's trajectory, rows by index; every record must come from one
    call (same image size and sampler)."""
    records = sorted(records, key=lambda r: r["index"])
    out: dict[str, Any] = {}
    for f in dataclasses.fields(BagelTrajectory):
        values = [r[f.name] for r in records]
        if isinstance(values[0], torch.Tensor) and values[0].ndim >= 1:
            out[f.name] = torch.cat(values)
        elif isinstance(values[0], list):
            out[f.name] = [v for vs in values for v in vs]
        else:
            if any(v != values[0] for v in values):
                raise ValueError(f"BAGEL records of one call disagree on {f.name}: {sorted(set(map(str, values)))}")
            out[f.name] = values[0]
    return BagelTrajectory(**out)


def _build_served_class() -> type:
    from vllm_omni.diffusion.data import DiffusionOutput

    from megatron_omni.rollout.vllm_omni.bagel import FlowGRPOBagelPipeline
    from model_providers.bagel.provider import bagel_shapes, read_bagel_config

    class ServedFlowGRPOBagelPipeline(FlowGRPOBagelPipeline):
        """`FlowGRPOBagelPipeline` as a vLLM-Omni worker builds it (see the module docstring)."""

        supports_step_execution = False  # each request carries its own seed, window and record
        weights_sources = ()  # the folder is loaded by the constructor: vLLM-Omni's loader streams nothing

        def __init__(self, *, od_config: Any, prefix: str = "") -> None:
            args = getattr(od_config, "custom_pipeline_args", None) or {}
            if "bagel_ae" not in args:
                raise ValueError("custom_pipeline_args lacks 'bagel_ae' (the FLUX autoencoder's sizes: "
                                 "bagel_served.omni_kwargs)")
            cfg = read_bagel_config(od_config.model)
            cfg["ae"] = dict(args["bagel_ae"])
            super().__init__(cfg, od_config.dtype)
            self.od_config = od_config
            self.full_shapes = bagel_shapes(cfg)
            self.load_folder(od_config.model)

        def load_weights(self, weights: Any) -> set[str]:
            """A BAGEL state dict (`load_folder`), or vLLM-Omni's loader stream, which is empty here (the folder
            is loaded already): answered with every parameter's name, so its strict check passes."""
            if isinstance(weights, dict):
                return super().load_weights(weights)
            extra = [name for name, _ in weights]
            if extra:
                raise ValueError(f"BAGEL served pipeline: unexpected loader tensors {extra[:4]}")
            return {name for name, _ in self.named_parameters()}

        # ------------------------------------------------------------------ the worker extension's hooks
        def load_bucket(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
            """One bucket of a weight update (`worker.WeightReceiver`): BAGEL-named full tensors."""
            loaded = self.load_partial(items)
            left = sorted({n for n, _ in items} - loaded)
            if left:
                raise ValueError(f"BAGEL weight update: the rollout loaded none of {left[:4]}")
            return loaded

        def weight_shapes(self) -> dict[str, tuple[int, ...]]:
            """What an update fills, as the bridge's target shows it: every BAGEL tensor at its full shape."""
            return dict(self.full_shapes)

        @torch.no_grad()
        def forward(self, req: Any) -> list[Any]:
            """One sample per request; vLLM-Omni's start-up warm-up request (no FlowGRPO extras) is answered with
            a two-step ODE image of the smallest size (2 x 2 latent tokens)."""
            if req.is_dummy_run():
                return [self._warm_up() for _ in req.prompts]
            outputs = []
            for prompt, sp in zip(req.prompts, req.sampling_params_list):
                ids, sampling, seed, index, group_id = parse_request(prompt, sp)
                traj = self.generate([ids], sampling, [seed], [group_id])
                outputs.append(DiffusionOutput(output=traj.images * 2 - 1,
                                               trajectory_latents=trajectory_record(traj, index)))
            return outputs

        def _warm_up(self) -> Any:
            tok = self.cfg["tokens"]
            side = 2 * self.bagel.latent_downsample
            traj = self.generate([torch.tensor([tok["bos_token_id"], tok["eos_token_id"]])],
                                 BagelSampling(num_timesteps=3, window_size=1, noise_level=0.0, height=side,
                                               width=side), [0])
            return DiffusionOutput(output=traj.images * 2 - 1)

    ServedFlowGRPOBagelPipeline.__module__ = __name__
    ServedFlowGRPOBagelPipeline.__qualname__ = "ServedFlowGRPOBagelPipeline"
    return ServedFlowGRPOBagelPipeline


__getattr__ = lazy_classes(__name__, {"ServedFlowGRPOBagelPipeline": _build_served_class})


def omni_kwargs(folder: str | os.PathLike, tp: int, dtype: torch.dtype, ae: dict[str, Any]) -> dict[str, Any]:
    """The `Omni(...)` keywords of a served BAGEL engine: the folder under vLLM-Omni's single-stage BAGEL topology,
    our pipeline class and worker extension, `tp` workers, sleep mode on."""
    from megatron_omni.rollout.vllm_omni.engine import executor_backend
    from megatron_omni.rollout.vllm_omni.pipeline import pipeline_args, single_stage_devices
    from megatron_omni.rollout.vllm_omni.worker import WORKER_EXTENSION

    return {"model": str(folder), "deploy_config": deploy_config_path(), "stage_overrides": single_stage_devices(tp),
            "custom_pipeline_args": {**pipeline_args(SERVED_BAGEL_PIPELINE_CLASS), "bagel_ae": dict(ae)},
            "worker_extension_cls": WORKER_EXTENSION, "tensor_parallel_size": int(tp),
            "dtype": str(dtype).removeprefix("torch."), "enable_sleep_mode": True,
            "distributed_executor_backend": executor_backend()}


class ServedBagelPipeline:
    """The trainer-side client of a served BAGEL engine: what the BAGEL trainer calls on its rollout pipeline.

    Args:
        folder: the BAGEL folder the engine serves.
        cfg: its BAGEL config dict with `ae` (`model_providers.bagel.provider.read_bagel_folder` + the preset's).
        dtype: the rollout's dtype (float32 or bfloat16).
        tp: the engine's worker processes (its tensor parallelism).
        group: the trainer ranks that share the engine (a process group whose ranks make the same calls: a
            trainer tensor-parallel group, whose ranks roll out the same samples); its first rank owns the engine
            and sends the others each trajectory. None: this rank alone.
        omni: an already started engine (tests); None starts one on the owner (`start`).
    A start-up failure on the owner is raised on every rank of the group, naming the owner's error.
    """

    kind = "vllm_omni"

    def __init__(self, folder: str | os.PathLike, cfg: dict[str, Any], dtype: torch.dtype = torch.float32,
                 tp: int = 1, group: Any = None, omni: Any = None) -> None:
        self.folder, self.cfg, self.dtype, self.tp, self.group = Path(folder), cfg, dtype, int(tp), group
        self.owner = 0 if group is None else dist.get_global_rank(group, 0)
        self.omni = None
        self._workers: list[Any] = []
        self._asleep = False
        if self.owns:
            self.omni = self._shared(lambda: omni if omni is not None else start(folder, tp, dtype, cfg["ae"]),
                                     "start", send=False)
            from megatron_omni.rollout.vllm_omni.faults import worker_processes

            self._workers = worker_processes(self.omni)
        else:
            self._shared(lambda: None, "start", send=False)

    @property
    def owns(self) -> bool:
        """Whether this rank owns the engine."""
        return self.group is None or dist.get_rank() == self.owner

    def _shared(self, compute: Any, what: str, send: bool = True) -> Any:
        """`compute()` on the owner; with a group, its result (`send`) or only whether it failed reaches the
        others, and a failure is raised on every rank (none waits for an answer that never comes)."""
        if self.group is None:
            return compute()
        from megatron_omni.rollout.vllm_omni.faults import shared_by_owner

        def failure(_died: bool, kind: str, message: str) -> Exception:
            return RuntimeError(f"the served BAGEL engine's owner (rank {self.owner}) failed in {what}: {kind}: "
                                f"{message}")

        return shared_by_owner(compute, self.owner, self.group, failure, send=send)

    def generate(self, prompt_ids: Sequence[torch.Tensor], sampling: BagelSampling, seeds: Sequence[int],
                 group_ids: Sequence[int] | None = None) -> BagelTrajectory:
        """One sample per (prompt ids [L], seed), as `FlowGRPOBagelPipeline.generate` (same trajectory); with a
        group, collective (every rank passes the same arguments, the owner samples)."""
        return self._shared(lambda: self._generate(prompt_ids, sampling, seeds, group_ids), "a rollout")

    def _generate(self, prompt_ids: Sequence[torch.Tensor], sampling: BagelSampling, seeds: Sequence[int],
                  group_ids: Sequence[int] | None) -> BagelTrajectory:
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        if self._asleep:
            raise RuntimeError("the BAGEL engine is asleep; call wake_up() first")
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(seeds)} seeds")
        groups = list(group_ids) if group_ids is not None else [0] * len(seeds)
        requests = [sample_request(ids, seed, k, gid) for k, (ids, seed, gid) in enumerate(zip(prompt_ids, seeds,
                                                                                                 groups))]
        params = OmniDiffusionSamplingParams(height=sampling.height, width=sampling.width,
                                             num_inference_steps=sampling.num_steps,
                                             extra_args={EXTRA_KEY: sampling_extra(sampling)})
        records = []
        with self._guard("a rollout"):
            for out in self.omni.generate(requests, params, py_generator=True, use_tqdm=False):
                if getattr(out, "error", None):
                    raise RuntimeError(f"vLLM-Omni request failed: {out.error}")
                record = getattr(out, "trajectory_latents", None)
                if not isinstance(record, dict) or "index" not in record:
                    raise RuntimeError("vLLM-Omni output carries no BAGEL trajectory record: is the engine running "
                                       f"{SERVED_BAGEL_PIPELINE_CLASS}?")
                records.append(record)
        if len(records) != len(requests):
            raise RuntimeError(f"vLLM-Omni returned {len(records)} samples for {len(requests)} requests")
        return concat_records(records)

    def _guard(self, what: str) -> Any:
        from megatron_omni.rollout.vllm_omni.engine import guarded

        return guarded(self._workers, what, None)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        from megatron_omni.rollout.vllm_omni.engine import stage_replies

        with self._guard(f"collective_rpc({method!r})"):
            return stage_replies(self.omni.engine.collective_rpc(method, args=args), method)

    def weight_target(self) -> Any:
        """The bridge's rollout target on the owner (None on the others): every worker, one bucket RPC per
        `load_full` (full BAGEL-named tensors; each worker checks names and shapes), the coverage shapes from the
        workers. Use inside `weight_update()`."""
        from megatron_omni.rollout.vllm_omni.engine import RpcTarget

        return RpcTarget(self._rpc, self.tp) if self.owns else None

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """Around a sync: the workers' update opened and, when the sync returned, closed (each worker refuses a
        partial one, naming a tensor that was not sent)."""
        if self.owns:
            self._rpc("begin_weight_update")
        yield
        if self.owns:
            self._rpc("finish_weight_update")

    def update_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """A complete update in one call (owner only): begin, one bucket, finish (the workers refuse one that
        misses a tensor, naming it). Returns the names sent."""
        items = [(n, t.detach().cpu().contiguous()) for n, t in items]
        with self.weight_update():
            self._rpc("load_weight_bucket", items)
        return {n for n, _ in items}

    def sleep(self) -> None:
        """Free the engine's weights' memory while the trainer trains (vLLM-Omni's sleep, level 1)."""
        if self.owns and not self._asleep:
            self._rpc("sleep", 1)
        self._asleep = True

    def wake_up(self) -> None:
        if self.owns and self._asleep:
            self._rpc("wake_up", None)
        self._asleep = False

    def close(self) -> None:
        """Stop the engine and its workers."""
        if self.omni is not None:
            self.omni.close()
            self.omni = None


def start(folder: str | os.PathLike, tp: int, dtype: torch.dtype, ae: dict[str, Any]) -> Any:
    """vLLM-Omni's `Omni` over a BAGEL folder (see `omni_kwargs`), on this node's devices from LOCAL_RANK (or the
    host); what a worker would refuse about the folder is refused here first, by name."""
    from megatron_omni.rollout.vllm_omni.engine import start_engine

    check_folder(folder)
    return start_engine(omni_kwargs(folder, tp, dtype, ae), tp)
