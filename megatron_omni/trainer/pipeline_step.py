"""The trainer's passes over micro-batches through Megatron-Core's schedules, at any pipeline size.

A micro-batch is a chunk of training points (sample, j): for the policy-gradient rules a transition (sample,
window step), for DiffusionNFT a noised point (sample, noise level); each row of a forward carries its own
latents and timestep, so one forward may hold several of a sample's points (`optim.micro_batch_size` counts
them, as the planner does). Every stage pulls the same `MicroBatch` and builds the same velocity batch from it
(an objective's `inputs`, e.g. `algorithms.transition.transition_inputs`: conditional rows, then the negative
rows of the CFG samples, text padded to one length); the first stage feeds its tensors to the model, later
stages the hidden states the schedule received. The last stage gathers its image tokens over context
parallelism and hands the raw velocities to the objective's `loss` (FlowGRPO's runs the transition math the
rollout and the pp=1 recompute share: true CFG, SDE step, log-prob; `trainer.objectives`). pp=1 runs
Megatron-Core's no-pipelining schedule, pp>1 its 1F1B schedule (`get_forward_backward_func`), so both go
through the same code.

Loss scaling is Megatron's: the schedule multiplies each micro-batch's loss by the CP size (DDP averages
over dp x cp while CP grads are partial sums) and divides it by the number of micro-batches. With equal
micro-batches that is the mean over window steps of the mean over samples, the loss of the whole
mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from torch import nn

from megatron_omni.algorithms.transition import TransitionInputs, transition_inputs, transition_output
from megatron_omni.algorithms.velocity import GuidedBatch
from megatron_omni.models.dit.config import MMDiTConfig
from megatron_omni.models.dit.diffusers_interface import gather_image_shards
from megatron_omni.models.dit.model import DiTBatch, pipeline_seq_length
from megatron_omni.parallel.groups import ParallelGroups
from megatron_omni.rollout.base import Trajectory


@dataclass(frozen=True)
class MicroBatch:
    """Training points: sample `rows[i]` at point `js[i]` (its window step, or DiffusionNFT's noise level);
    rows, js [b] long indices into the trajectory."""

    rows: torch.Tensor
    js: torch.Tensor


class Objective(Protocol):
    """What one RL step's update computes per micro-batch (`trainer.objectives`): the forward's batch of a
    micro-batch (`inputs(mb).batch`, a `GuidedBatch`, the same on every stage) and, on the last stage, the loss
    from the raw velocities of its rows ([B + K, S, C]) with the micro-batch's metrics (floats). `traj` holds the
    step's N samples, each trained at `points` points."""

    traj: Trajectory

    @property
    def points(self) -> int: ...

    def inputs(self, mb: MicroBatch) -> Any: ...

    def loss(self, mb: MicroBatch, inputs: Any, v_all: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]: ...


def plan_micro_batches(rows: torch.Tensor, window: int, micro_batch_size: int | None) -> list[MicroBatch]:
    """The micro-batches of one mini-batch of samples `rows` [B]: its B x `window` points (window steps, or
    DiffusionNFT's noise levels), point by point, split in chunks of `micro_batch_size` (None: B, one point of
    every sample per forward, as flow_grpo does; B x window puts the whole mini-batch in one forward). Chunks
    must be equal: one schedule call passes one tensor shape."""
    n = len(rows) * window
    mbs = len(rows) if micro_batch_size is None else micro_batch_size
    if mbs < 1 or n % mbs:
        raise ValueError(f"optim.micro_batch_size={micro_batch_size} does not divide the mini-batch's {n} "
                         f"transitions on this rank ({len(rows)} samples x {window} window steps)")
    all_rows = rows.repeat(window)
    all_js = torch.arange(window, dtype=torch.long).repeat_interleave(len(rows))
    return [MicroBatch(r, j) for r, j in zip(all_rows.split(mbs), all_js.split(mbs), strict=True)]


@dataclass
class Transitions:
    """Forward-only result: log_probs [N, W] fp32 on every rank of the model replica; means [N, W, S, C]
    fp32 on the last pipeline stage (None elsewhere, or when not requested)."""

    log_probs: torch.Tensor
    means: torch.Tensor | None


class PipelineStep:
    """Forward-only transitions and loss forward/backward of one model replica over a list of micro-batches.

    `config`: the model's Megatron config (pipeline_dtype set; batch_p2p_comm=False on gloo).
    """

    def __init__(self, config: MMDiTConfig, groups: ParallelGroups) -> None:
        self.config = config
        self.groups = groups
        self.pp = groups.layout.pp
        self.dtype = config.params_dtype
        self.schedule = get_forward_backward_func(pp_size=self.pp, vp_size=None)
        self.p2p = P2PCommunicator(pp_group=groups.pp, config=config) if self.pp > 1 else None
        self.is_last_stage = groups.is_last_stage
        self.last_stage_rank = groups.last_stage_rank

    # -------------------------------------------------------------------------------------------- plumbing

    def _velocity(self, output: torch.Tensor) -> torch.Tensor:
        """The last stage's output [b, s_img / cp, c] -> the raw velocities of all image tokens [b, s_img, c]."""
        return gather_image_shards(output, self.groups.cp)

    def _run(self, model: nn.Module, micro_batches: Sequence[MicroBatch], make_inputs: Callable[[MicroBatch], Any],
             loss_fn: Callable, forward_only: bool) -> list:
        # Built once: the schedule needs their common shape before the first forward.
        prepared = [(mb, make_inputs(mb)) for mb in micro_batches]
        shapes = {(i.batch.latents.shape[0], i.batch.text.shape[1], i.batch.stream_tokens) for _, i in prepared}
        if len(shapes) != 1:
            raise ValueError(f"micro-batches of one schedule call must share one shape (rows, text, image "
                             f"tokens); got {sorted(shapes)}")
        rows, s_txt, s_img = shapes.pop()
        dtype = self.dtype

        def forward_step(data_iterator, module):
            mb, inputs = next(data_iterator)
            x = inputs.batch.model_inputs(dtype)
            out = module(DiTBatch(x["hidden_states"], x["encoder_hidden_states"], x["encoder_hidden_states_mask"],
                                  x["timestep"], tuple(inputs.batch.img_shape), inputs.batch.cond_shapes,
                                  x.get("pooled_projections"), x.get("guidance")))
            return out, partial(loss_fn, mb, inputs)

        return self.schedule(
            forward_step_func=forward_step, data_iterator=iter(prepared), model=[model],
            num_microbatches=len(micro_batches), seq_length=pipeline_seq_length(s_txt, s_img, self.groups.layout.cp),
            micro_batch_size=rows, forward_only=forward_only, collect_non_loss_data=forward_only,
            p2p_communicator=self.p2p, pg_collection=self.groups.mcore,
        )

    def from_last_stage(self, obj):
        """`obj` as the last pipeline stage has it, on every stage (collective over the pp group)."""
        if self.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.groups.pp)
        return box[0]

    # ------------------------------------------------------------------------------------------ the passes

    @torch.no_grad()
    def transitions(self, model: nn.Module, traj: Trajectory, micro_batches: Sequence[MicroBatch],
                    return_means: bool = False) -> Transitions:
        """Log-probs [N, W] of every transition the micro-batches cover under `model`, forward only (and the
        transition means [N, W, S, C] on the last stage when `return_means`); every (sample, step) of the
        trajectory must be covered. Collective over the model replica."""
        n, w = traj.log_probs.shape
        log_probs = torch.full((n, w), float("nan"), dtype=torch.float32, device=traj.latents.device)
        means = torch.empty_like(traj.latents) if return_means and self.is_last_stage else None

        def loss_fn(mb: MicroBatch, inputs: TransitionInputs, output: torch.Tensor, non_loss_data: bool = True):
            step = transition_output(traj, inputs, self._velocity(output))
            log_probs[mb.rows, mb.js] = step.log_prob
            if means is not None:
                means[mb.rows, mb.js] = step.coeffs.mean
            return None

        self._run(model, micro_batches, lambda mb: transition_inputs(traj, mb.rows, mb.js), loss_fn,
                  forward_only=True)
        if self.is_last_stage and bool(log_probs.isnan().any()):
            raise ValueError(f"the micro-batches left {int(log_probs.isnan().sum())} of {n * w} transitions "
                             "without a log-prob")
        if self.pp > 1:
            dist.broadcast(log_probs, src=self.last_stage_rank, group=self.groups.pp)
        return Transitions(log_probs=log_probs, means=means)

    @torch.no_grad()
    def velocities(self, model: nn.Module, micro_batches: Sequence[MicroBatch],
                   make_inputs: Callable[[MicroBatch], Any], shape: tuple[int, ...],
                   device: torch.device | None = None) -> torch.Tensor | None:
        """The guided velocity (true CFG combined) of every point the micro-batches cover under `model`, forward
        only: [N, J, S, C] fp32 (`shape`) on the last stage, None elsewhere; every point must be covered.
        `make_inputs(mb).batch` is the forward's `GuidedBatch`. Collective over the model replica."""
        out = torch.full(shape, float("nan"), dtype=torch.float32, device=device) if self.is_last_stage else None

        def loss_fn(mb: MicroBatch, inputs: Any, output: torch.Tensor, non_loss_data: bool = True):
            batch: GuidedBatch = inputs.batch
            out[mb.rows, mb.js] = batch.combine(self._velocity(output))
            return None

        self._run(model, micro_batches, make_inputs, loss_fn, forward_only=True)
        if out is not None and bool(out.isnan().any()):
            raise ValueError("the micro-batches left points without a velocity")
        return out

    def forward_backward(self, model: nn.Module, micro_batches: Sequence[MicroBatch],
                         objective: Objective) -> list[dict[str, float]]:
        """Forward and backward of `objective`'s loss over the micro-batches (grads accumulate in the DDP
        buffers; no optimizer step). Returns each micro-batch's metrics on every stage."""

        def loss_fn(mb: MicroBatch, inputs: Any, output: torch.Tensor):
            return objective.loss(mb, inputs, self._velocity(output))

        store = self._run(model, micro_batches, objective.inputs, loss_fn, forward_only=False)
        return self.from_last_stage(list(store) if self.is_last_stage else None)
