"""The back buffer of a vLLM-Omni engine's transformer, in its workers (the asynchronous rollout, docs/async.md).

A rollout rank of a disaggregated job (`placement.mode=disaggregated`, `rollout.engine=vllm_omni`) owns an `Omni`
engine whose worker processes hold the live transformer. The trainer's push reaches them over `collective_rpc`
into a second copy of every transformer parameter (`BackBufferWorkerExtension`, mixed into our worker extension):
`back_buffer_begin`, `back_buffer_load(bucket)` (full diffusers-named tensors, through vLLM-Omni's own loader and
the same name / shape / completeness checks as a live update, `worker.WeightReceiver`), `back_buffer_finish`
(refuses a partial update, naming what was not sent) and `back_buffer_swap` (the storage of each live parameter
exchanged with its back copy, no copy). A worker runs one message at a time, so a bucket RPC never meets a
forward: the load points the parameters at the back copies, loads, and points them back; a request sees the old
weights until the swap, which the rollout service sends between two requests.

`RpcBackBuffer` is the rollout owner's side: the bridge's target over those RPCs (full mode at the engine's tp: every
worker slices the full tensors, worker 0's shard shapes are the coverage check) with the `begin` / `finish` / `swap`
the async `WeightReceiver` calls.

An FP8 engine (vLLM's FP8 linears, loaded through a layer-wise reloader that quantizes in place) keeps its back copy
before quantization (`QuantizedBackBuffer`): the update's full tensors, checked by name and full shape as they
arrive and for completeness at `finish`; the swap loads them through the worker's `WeightReceiver` (quantized there,
one layer-wise reload), between two requests like every swap. The same memory as the unquantized back copy (one
transformer in the engine's dtype) and one reload's time per swap.
Nothing here imports vllm at module level (the worker extension imports this module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class BackBuffer:
    """The back copy of one pipeline's transformer parameters in one worker. The update logic is the worker's
    `WeightReceiver` (checks, vLLM-Omni's loader, completeness), run with the parameters pointed at the back copy."""

    def __init__(self, pipeline: Any) -> None:
        from megatron_omni.rollout.vllm_omni.worker import WeightReceiver, WeightUpdateError

        if getattr(pipeline, "fp8_reloader", None) is not None:
            raise WeightUpdateError("an FP8 vLLM-Omni engine's linears reload layer-wise in place: its back copy is "
                                    "a QuantizedBackBuffer")
        self.pipeline = pipeline
        self.receiver = WeightReceiver(pipeline)
        self.params = dict(pipeline.transformer.named_parameters())
        self.back = {n: p.detach().clone() for n, p in self.params.items()}
        self.ready = False  # the back copy holds a complete update not swapped in yet
        self.swaps = 0

    @torch.no_grad()
    def _exchange(self) -> None:
        for name, p in self.params.items():
            p.data, self.back[name] = self.back[name], p.data

    def begin(self) -> None:
        self.ready = False
        self.receiver.begin()

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        self._exchange()
        try:
            return self.receiver.load(named_tensors)
        finally:
            self._exchange()

    def finish(self) -> int:
        count = self.receiver.finish()  # raises on a partial update: the back copy is then not swappable
        self.ready = True
        return count

    def swap(self) -> int:
        from megatron_omni.rollout.vllm_omni.worker import WeightUpdateError

        if not self.ready:
            raise WeightUpdateError("back_buffer_swap without a complete back-buffer update (begin, buckets, "
                                    "finish): the live weights are kept")
        self._exchange()
        self.ready = False
        self.swaps += 1
        return self.swaps


class QuantizedBackBuffer:
    """The back copy of an FP8 engine's transformer in one worker: the update's full (unquantized) tensors, held
    until the swap quantizes them into the live FP8 linears through the worker's `WeightReceiver`."""

    def __init__(self, pipeline: Any) -> None:
        from megatron_omni.rollout.vllm_omni.worker import WeightReceiver

        self.pipeline = pipeline
        self.receiver = WeightReceiver(pipeline)
        self.full_shapes = {n: tuple(s) for n, s in pipeline.full_shapes.items()}
        self.held: dict[str, torch.Tensor] = {}
        self.ready = False
        self.swaps = 0

    def begin(self) -> None:
        self.ready = False
        self.held = {}

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        from megatron_omni.rollout.vllm_omni.worker import WeightUpdateError

        for name, t in named_tensors:
            name = name.removeprefix("transformer.")
            if name not in self.full_shapes:
                raise WeightUpdateError(f"malformed weight bucket: unknown transformer weight {name!r}")
            if tuple(t.shape) != self.full_shapes[name]:
                raise WeightUpdateError(f"malformed weight bucket: {name}: shape {tuple(t.shape)} != the model's "
                                        f"full shape {self.full_shapes[name]}")
            if name in self.held:
                raise WeightUpdateError(f"weight update sends {name!r} more than once")
            self.held[name] = t.detach().clone()
        return len(named_tensors)

    def finish(self) -> int:
        from megatron_omni.rollout.vllm_omni.worker import WeightUpdateError

        missing = sorted(set(self.full_shapes) - set(self.held))
        if missing:
            self.held = {}
            raise WeightUpdateError(f"partial back-buffer update: {len(missing)} of {len(self.full_shapes)} "
                                    f"transformer tensors were not sent, e.g. {missing[:3]}; the live weights are kept")
        self.ready = True
        return len(self.held)

    def swap(self) -> int:
        from megatron_omni.rollout.vllm_omni.worker import WeightUpdateError

        if not self.ready:
            raise WeightUpdateError("back_buffer_swap without a complete back-buffer update (begin, buckets, "
                                    "finish): the live weights are kept")
        self.receiver.begin()
        self.receiver.load(list(self.held.items()))
        self.receiver.finish()  # the layer-wise reload: quantized, scales set
        self.held, self.ready = {}, False
        self.swaps += 1
        return self.swaps


class BackBufferWorkerExtension:
    """The back-buffer RPCs of our worker extension (`worker.FlowGRPOWorkerExtension`); each runs on every worker."""

    def _flowgrpo_back_buffer(self) -> BackBuffer | QuantizedBackBuffer:
        pipeline = self.model_runner.pipeline
        buffer = getattr(self, "_flowgrpo_back", None)
        if buffer is None or buffer.pipeline is not pipeline:
            fp8 = getattr(pipeline, "fp8_reloader", None) is not None
            buffer = QuantizedBackBuffer(pipeline) if fp8 else BackBuffer(pipeline)
            self._flowgrpo_back = buffer
        return buffer

    def back_buffer_begin(self) -> None:
        """Start an update of the back copy (allocated on the first call: one more transformer's memory)."""
        self._flowgrpo_back_buffer().begin()

    def back_buffer_load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of full diffusers-named tensors into the back copy; returns how many."""
        return self._flowgrpo_back_buffer().load(named_tensors)

    def back_buffer_finish(self) -> int:
        """Check the back copy's update was complete; returns the number of tensors received."""
        return self._flowgrpo_back_buffer().finish()

    def back_buffer_swap(self) -> int:
        """Make the back copy live (and the live one the back copy); returns this worker's swap count."""
        return self._flowgrpo_back_buffer().swap()


class RpcBackBuffer:
    """The rollout rank's view of its engine workers' back buffers: a bridge target (kind vllm_omni, full mode)
    whose loads are `back_buffer_load` RPCs, and the `begin` / `finish` / `swap` around them. `rpc`: the engine's
    `method(*args) -> [worker replies]` (`VllmOmniRolloutEngine._rpc`); `tp_size`: its workers (each slices the
    full tensors it is sent; worker 0's shard shapes are the plan's coverage check, as for a live update)."""

    kind = "vllm_omni"
    tp_rank = 0

    def __init__(self, rpc: Callable[..., list[Any]], tp_size: int = 1) -> None:
        self.rpc = rpc
        self.tp_size = tp_size
        self._params = {n: torch.empty(s, device="meta") for n, s in rpc("parameter_shapes")[0].items()}
        self._error: BaseException | None = None

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._params

    def _call(self, method: str, *args: Any) -> None:
        """`method` on the workers, unless an earlier RPC of this update failed: the bridge's broadcast with the
        trainer goes on to its end (the trainer would hang in it otherwise), and `finish` raises the first error."""
        if self._error is None:
            try:
                self.rpc(method, *args)
            except Exception as exc:  # noqa: BLE001 - raised by finish, after the broadcast
                self._error = exc

    def load_full(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        self._call("back_buffer_load", [(n, t.detach().cpu().contiguous()) for n, t in items])
        return {n for n, _ in items}

    def begin(self) -> None:
        self._error = None
        self._call("back_buffer_begin")

    def finish(self) -> None:
        self._call("back_buffer_finish")
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the vLLM-Omni engine's back-buffer update failed: {error}") from error

    def swap(self) -> None:
        self.rpc("back_buffer_swap")
