"""Weights without tearing: the rollout side receives a new policy version into a second buffer while it keeps
sampling with the live one, and swaps the two only between two requests, so no sample is ever drawn with
half-updated weights; the probe check runs on every swap.

- `DoubleBuffer` is the bridge's `RolloutTarget` over the back buffer of a module's parameters: the bridge
  (`WeightSync` over `DistributedTransport`) writes full diffusers-named tensors into it and its coverage check
  covers it like any target; `swap` exchanges each parameter's storage with its back copy (no copy, O(params)).
- `WeightReceiver` orders receives and swaps: a receive waits while the back buffer holds a version that a request
  already received still needs (so a version is never overwritten before its requests start), and `ensure(v)`
  (called by the service between requests) swaps version v in, waiting a bounded time for it to arrive, then
  checks the engine's probe forward against the trainer's means sent with the version (`probe.check_probe`).
- `push_weights` is the trainer side: the root announces the version (with its probe means) to every rollout rank,
  then every trainer rank runs its `WeightSync` (collective: the tp gathers and the broadcast).

A quantized engine (`rollout.quantization=fp8`, ModelOpt's fake quantization in the embedded engine) is
re-quantized right after each swap, in the main thread between two requests, and held to the quantized probe check
(`probe.check_quantized_probe`: its unquantized view within the dtypes' tolerance of the trainer's, its quantized
means within the quantizer's bound), as the colocated engine after each sync.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import torch

from megatron_omni.bridge.sync import SyncStats, WeightSync
from megatron_omni.bridge.targets import DiffusersTarget
from megatron_omni.rollout.async_service.channel import Weights
from megatron_omni.rollout.probe import probe_tolerance, probe_trajectory
from megatron_omni.rollout.quantization import QuantizationSpec, check_engine_probe


class DoubleBuffer(DiffusersTarget):
    """The back buffer of `module`'s parameters as a diffusers-layout bridge target (rollout tp 1): the bridge
    writes into the back copies (`parameters`, `load_full` are the diffusers target's over them) while the
    engine samples with the live ones."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._live = dict(module.named_parameters())
        self._params = {n: p.detach().clone() for n, p in self._live.items()}

    @torch.no_grad()
    def swap(self) -> None:
        """Make the back buffer live and the live one the back buffer (storage exchange, no copy)."""
        for name, p in self._live.items():
            old = p.data
            p.data = self._params[name]
            self._params[name] = old

    def begin(self) -> None:
        """Nothing: the bridge's coverage check covers the back buffer in this process."""

    def finish(self) -> None:
        """Nothing (see `begin`)."""


def async_buffer(engine: Any) -> Any:
    """The back buffer the asynchronous rollout swaps in `engine`: an embedded diffusers engine's transformer
    (`DoubleBuffer`, in this process), or a vLLM-Omni `Omni` engine's workers (`vllm_omni.back_buffer.RpcBackBuffer`,
    over `collective_rpc`). Refuses any other engine, naming its weight sink."""
    sink = engine.weight_sink()
    if sink.kind == "diffusers" and sink.target is not None and hasattr(sink.target, "module"):
        return DoubleBuffer(sink.target.module)
    if sink.kind == "vllm_omni" and sink.target is not None and not engine.in_process:
        from megatron_omni.rollout.vllm_omni.back_buffer import RpcBackBuffer

        return RpcBackBuffer(engine._rpc, engine.tp)
    raise ValueError(f"the asynchronous rollout double-buffers an embedded diffusers engine's transformer or a "
                     f"vLLM-Omni Omni engine's workers; this engine's weight sink is {sink.kind!r}")


def check_async_engine(engine: Any) -> None:
    """Refuse an engine the asynchronous rollout cannot double-buffer, naming the setting."""
    async_buffer(engine)


class WeightReceiver:
    """The rollout rank's side of the weights: `receive` (the service's control thread) and `ensure` (its main
    thread, between requests). `plan`: the bridge's full-mode plan into a diffusers target at rollout tp 1;
    `transport`: the `DistributedTransport` over the placement's weights group; `trainer_dtype`: the trainer's
    parameter dtype (the probe's tolerance is the looser of it and the engine's)."""

    def __init__(self, engine: Any, plan: Any, transport: Any, trainer_dtype: torch.dtype, rank: int,
                 wait_timeout_s: float) -> None:
        self.engine = engine
        self.rank = rank
        self.wait_timeout_s = wait_timeout_s
        self.buffer = async_buffer(engine)
        self.sync = WeightSync(plan, sources=None, target=self.buffer, transport=transport, dtype=trainer_dtype)
        self.probe = probe_trajectory(engine.transformer_config())
        self.tolerance = probe_tolerance(trainer_dtype, engine.dtype)
        self.quantization = getattr(engine, "quantization", None) or QuantizationSpec()
        self.live_version = 0
        self.back_version: int | None = None
        self._probe_means: torch.Tensor | None = None
        self._wanted: Counter[int] = Counter()
        self._cond = threading.Condition()
        self.last_sync: SyncStats | None = None
        self.swaps = 0
        self.last_probe_diff: float | None = None
        self.probe_diffs: list[float] = []  # every swap's probe max |difference|, in order
        self._failure: BaseException | None = None  # a receive that failed (the engine's back-buffer RPCs)

    def want(self, version: int) -> None:
        """A request for `version` was received: keep that version in the back buffer until it is swapped in."""
        with self._cond:
            self._wanted[version] += 1

    def release(self, version: int) -> None:
        """A request for `version` started (after `ensure`) or was cancelled."""
        with self._cond:
            self._wanted[version] -= 1
            if self._wanted[version] <= 0:
                del self._wanted[version]
            self._cond.notify_all()

    def receive(self, msg: Weights) -> SyncStats:
        """Receive policy version `msg.version` into the back buffer (blocking on the bridge's broadcast)."""
        with self._cond:
            # A back buffer that a received request still needs is not overwritten: wait for its swap.
            self._cond.wait_for(lambda: self.back_version is None or self._wanted[self.back_version] == 0)
            self.back_version = None  # being written
        self.buffer.begin()
        try:
            stats = self.sync.sync()
            self.buffer.finish()  # the engine's workers refuse a partial update (the bridge's coverage check, here)
        except BaseException as exc:
            with self._cond:
                self._failure = exc  # `ensure` raises it instead of waiting for a version that cannot come
                self._cond.notify_all()
            raise
        with self._cond:
            self.back_version = msg.version
            self._probe_means = msg.probe_means
            self.last_sync = stats
            self._cond.notify_all()
        return stats

    def ensure(self, version: int) -> float:
        """Make `version` live (swap it in if it is the back buffer's, waiting up to `wait_timeout_s` for it to
        arrive) and check the probe; returns the seconds spent. Raises TimeoutError naming the version, and
        `ProbeMismatch` when the swapped-in weights are not the trainer's."""
        if version == self.live_version:
            return 0.0
        t0 = time.perf_counter()
        with self._cond:
            arrived = self._cond.wait_for(lambda: self.back_version == version or self._failure is not None,
                                          timeout=self.wait_timeout_s)
            if self._failure is not None:
                raise RuntimeError(f"rollout rank {self.rank}: receiving a policy version failed, version {version} "
                                   f"cannot be swapped in: {self._failure}") from self._failure
            if not arrived:
                raise TimeoutError(f"rollout rank {self.rank}: policy version {version} did not arrive within "
                                   f"{self.wait_timeout_s:.0f} s (live {self.live_version}, back "
                                   f"{self.back_version})")
            self.buffer.swap()
            self.live_version, self.back_version = version, None
            means = self._probe_means
            self._cond.notify_all()
        if self.quantization.enabled:
            self.engine.requantize()  # the FP8 scales of the weights just swapped in
        self.last_probe_diff, _ = check_engine_probe(self.engine, self.quantization, self.probe, means,
                                                     self.tolerance, f"after the swap to policy version {version} "
                                                     f"on rollout rank {self.rank}")
        self.swaps += 1
        self.probe_diffs.append(float(self.last_probe_diff))
        return time.perf_counter() - t0


def push_weights(version: int, weight_sync: WeightSync, probe_means: torch.Tensor | None,
                 client: Any | None) -> SyncStats:
    """The trainer side of one weight push, on every trainer rank (collective): the root (`client`, the
    `RolloutClient`; None on the other trainer ranks) announces `version` with its probe means [1, 1, 4, C], then
    every trainer rank runs the bridge's sync into the rollout ranks' back buffers."""
    if client is not None:
        if probe_means is None:
            raise ValueError("the trainer root must send the probe means with the weights")
        client.announce_weights(Weights(version, probe_means.detach().float().cpu()))
    return weight_sync.sync()
