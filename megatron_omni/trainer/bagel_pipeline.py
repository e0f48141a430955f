"""BAGEL RL's recompute and update at pipeline size > 1 (`trainer.bagel` at `parallel.pp` > 1).

Per sample the prompt's text KV is built stage after stage (`models.bagel.model.pipeline_run`, no autograd: the
understanding expert is frozen); each stage keeps the KV of its own layers. A window transition needs two
velocities under text CFG (the text-conditioned branch and the unconditional one: no text KV, RoPE position 0),
which one 1F1B micro-batch cannot carry together (its loss sees one forward's output), so the update runs in two
passes:

1. forward only, every branch of every window step (`pipeline_run`): the last stage holds the raw velocities
   [n, p] and computes the policy-gradient loss over the window's transitions exactly as pp 1 does
   (`trainer.bagel.window_transitions` with the velocities given: CFG combination, SDE step, log-probs, FlowGRPO's
   clipped surrogate or GRPO-Guard's normalised ratio with the recompute's transition means,
   `bagel_objectives.window_policy_loss`), then its gradient with respect to each velocity, g = dL/dv;
2. forward and backward under Megatron-Core's 1F1B schedule (`models.bagel.schedule.velocity_forward_backward`,
   one call per sample and branch, its window steps the micro-batches) of the linear surrogate `<g, v>` per
   micro-batch (times the number of micro-batches: the schedule divides by it), whose parameter gradient is
   `sum g . dv/dtheta`, the chain rule of the pp 1 backward at the same velocities.

The second forward recomputes what the first computed (same inputs, same weights). Pass 1 of the first mini-batch
is the old log-probs' forward itself (`window_log_probs` keeps it: no update has moved the weights in between), so
with one mini-batch a step runs the window forward twice, as at pp 1 (the old log-probs, then the update's forward
with its backward), not three times. Loss metrics come from the last
stage, broadcast over the pp group.

The KL term (`algorithm.beta > 0`) joins pass 1: the reference (the frozen initial copy, or with LoRA the model
with its adapters off) runs forward only through the pipeline over the same branches, the last stage takes its
transition means and adds `beta * KL` to the loss before taking g = dL/dv, so pass 2 carries the KL's gradient too.
The reference reuses the model's text KV: the understanding expert that builds it is frozen (and never adapted),
so the copy's is the same. LoRA and the EMA need nothing here: the adapters are modules of each stage's layers
(pass 2's backward reaches them), the EMA is updated per rank on its own shards after the optimizer step.

DiffusionNFT (`nft_velocities`, `nft_backward`) runs the same two passes over each sample's noised points instead
of its window steps (a point is latents, t and the CFG scale the rollout applied at that t: `Points`): the old
policy's and the reference's velocities forward only, then pass 1 gives the last stage the current raw velocities,
which it guides and feeds to `algorithms.nft.nft_loss` (`BagelNftStep.loss_of`, pp 1's), and pass 2 back-propagates
`<g, v>`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.models.bagel.model import latent_position_ids, pipeline_run
from megatron_omni.models.bagel.schedule import velocity_forward_backward
from megatron_omni.rollout.vllm_omni.bagel import BagelTrajectory

Key = tuple[int, int, bool]  # (sample, window step, text-conditioned)


# One sample's velocity inputs: the points' latents [J, n, p], BAGEL's t of each [J] and the text CFG scale each
# is guided with (1: the text-conditioned branch alone)
Points = tuple[torch.Tensor, torch.Tensor, list[float]]


def window_points(traj: BagelTrajectory) -> list[Points]:
    """Each sample's window steps as velocity inputs: the recorded latents, t and CFG scale."""
    return [(traj.latents[i], traj.sigmas[i].float(), [float(c) for c in traj.cfg_scales[i]])
            for i in range(len(traj))]


def _branches(scales: list[float]) -> list[tuple[bool, list[int]]]:
    """A sample's branches and the points each runs at: the text-conditioned branch at every point, the
    unconditional one where the point's CFG scale is > 1."""
    cond = list(range(len(scales)))
    uncond = [j for j in cond if scales[j] > 1]
    return [(True, cond)] + ([(False, uncond)] if uncond else [])


def _step_inputs(model: Any, traj: BagelTrajectory, x: torch.Tensor, t: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents [n, p], timesteps [n] and latent position ids [n] of one point (`trainer.bagel.velocity`'s)."""
    dtype = model.config.params_dtype
    x = x.to(dtype)
    h, w = traj.grid
    return x, torch.full((x.shape[0],), float(t), dtype=dtype), latent_position_ids(
        h, w, model.arch.max_latent_size)


@torch.no_grad()
def text_caches(model: Any, groups: Any, traj: BagelTrajectory) -> list[Any]:
    """Each sample's prompt text KV for this stage's layers (the text pass run stage after stage)."""
    h, dtype = model.config.hidden_size, model.config.pipeline_dtype
    caches = []
    for i in range(len(traj)):
        ids, box = traj.prompt_ids[i], {}

        def stage(hidden, ids=ids, box=box):
            out, box["kv"], _ = model.stage_text(ids, hidden)
            return out

        pipeline_run(stage, groups.pp, (ids.shape[0], 1, h), dtype)
        caches.append(box["kv"])
    return caches


@torch.no_grad()
def branch_velocities(model: Any, groups: Any, traj: BagelTrajectory, markers: torch.Tensor,
                      caches: list[Any], points: list[Points] | None = None) -> dict[Key, torch.Tensor] | None:
    """Raw velocities [n, p] fp32 of every branch at every point (forward only; `points`: each sample's, by default
    its window steps, `window_points`), by (sample, point, text) on the last stage; None elsewhere. Collective over
    the pp group."""
    h, dtype = model.config.hidden_size, model.config.pipeline_dtype
    points = window_points(traj) if points is None else points
    out: dict[Key, torch.Tensor] = {}
    for i, (xs, ts, scales) in enumerate(points):
        plen = traj.prompt_ids[i].shape[0]
        for text, js in _branches(scales):
            for j in js:
                x, t, pos = _step_inputs(model, traj, xs[j], float(ts[j]))

                def stage(hidden, x=x, t=t, pos=pos, text=text, i=i, plen=plen):
                    return model.stage_velocity(caches[i] if text else None, plen if text else 0, markers, x, t,
                                                pos, hidden)

                v = pipeline_run(stage, groups.pp, (x.shape[0] + 2, 1, h), dtype)
                out[i, j, text] = v.float()
    return out if groups.is_last_stage else None


def guided_velocities(traj: BagelTrajectory, points: list[Points], vs: dict[Key, torch.Tensor]) -> torch.Tensor:
    """[N, J, n, p]: the guided velocity at every point from its branches' raw velocities (`branch_velocities`), as
    `trainer.bagel.velocity` combines them (text CFG at the point's scale, the trajectory's image CFG and renorm);
    differentiable in `vs`."""
    from megatron_omni.models.bagel.model import text_cfg

    out = []
    for i, (_, _, scales) in enumerate(points):
        per = []
        for j, scale in enumerate(scales):
            v = vs[i, j, True]
            if scale > 1:
                v = text_cfg(v, vs[i, j, False], scale, traj.cfg_renorm_min, traj.cfg_img_scale, v)
            per.append(v)
        out.append(torch.stack(per))
    return torch.stack(out)


def surrogate_backward(model: Any, groups: Any, traj: BagelTrajectory, markers: torch.Tensor, caches: list[Any],
                       points: list[Points], grads: dict[Key, torch.Tensor]) -> None:
    """Pass 2 (the module docstring): per sample and branch, forward and backward under Megatron-Core's 1F1B
    schedule of the linear surrogate `<g, v>` of each point's raw velocity, `grads` g = dL/dv from the last stage
    (empty elsewhere). Collective over the pp group."""
    for i, (xs, ts, scales) in enumerate(points):
        plen = traj.prompt_ids[i].shape[0]
        for text, js in _branches(scales):
            steps = [_step_inputs(model, traj, xs[j], float(ts[j])) for j in js]

            def surrogate(k: int, v: torch.Tensor, i=i, js=js, text=text) -> torch.Tensor:
                return (grads[i, js[k], text] * v.float()).sum() * len(js)

            velocity_forward_backward(model, groups, caches[i] if text else None, plen if text else 0, markers,
                                      steps, surrogate)


class Forward:
    """One forward of a trajectory's window (`window_log_probs`): this stage's text KV per sample and, on the last
    stage, the raw branch velocities. The update's first mini-batch reuses it when the weights have not moved since
    (`rows`), instead of running pass 1's forward again."""

    def __init__(self, caches: list[Any], vs: dict[Key, torch.Tensor] | None) -> None:
        self.caches, self.vs = caches, vs

    def rows(self, rows: list[int]) -> Forward:
        """The forward of `traj.select(rows)` (samples renumbered 0..len(rows)-1, as the selection)."""
        vs = None if self.vs is None else {(k, j, t): v for (i, j, t), v in self.vs.items() if i in rows
                                           for k in [rows.index(i)]}
        return Forward([self.caches[i] for i in rows], vs)


def window_log_probs(model: Any, groups: Any, traj: BagelTrajectory, markers: torch.Tensor,
                     keep: list[Forward] | None = None, with_means: bool = False) -> Any:
    """Window log-probs [N, W] (fp32) under the pipelined model, on every stage (forward only); `keep` receives the
    forward (`Forward`). `with_means`: (log-probs, transition means [N, W, n, p] on the last stage, None on the
    others: GRPO-Guard's old means, used where its loss is computed). Collective over the pp group."""
    from megatron_omni.trainer.bagel import window_transitions

    caches = text_caches(model, groups, traj)
    vs = branch_velocities(model, groups, traj, markers, caches)
    if keep is not None:
        keep.append(Forward(caches, vs))
    means = None
    if vs is not None:
        with torch.no_grad():
            log_probs, means, _ = window_transitions(model, traj, markers, lambda i, j, text: vs[i, j, text])
        log_probs = log_probs.contiguous()
    else:
        log_probs = torch.empty(traj.log_probs.shape, dtype=torch.float32)
    dist.broadcast(log_probs, src=groups.last_stage_rank, group=groups.pp)
    return (log_probs, means) if with_means else log_probs


def policy_backward(model: Any, groups: Any, traj: BagelTrajectory, markers: torch.Tensor,
                    old: torch.Tensor, adv: torch.Tensor, clip_range: float | tuple[float, float],
                    beta: float = 0.0, reference: Callable[[], AbstractContextManager[Any]] | None = None,
                    forward: Forward | None = None, old_means: torch.Tensor | None = None) -> dict[str, float]:
    """Forward and backward of the policy-gradient loss over the window's transitions of `traj` (old log-probs
    [N, W], advantages [N]) on this rank's stage (grads accumulate in the DDP buffers; no optimizer step): the two
    passes of the module docstring. The loss is FlowGRPO's clipped surrogate, or GRPO-Guard's with `old_means`
    [N, W, n, p] (the recompute's transition means, read on the last stage only; `bagel_objectives.
    window_policy_loss`, pp 1's). `beta` > 0 adds the KL of the transitions against `reference()` (a context giving
    this stage's reference model; `trainer.bagel.BagelTrainer._reference`). `forward`: pass 1's forward already run
    at the current weights (the old log-probs', `window_log_probs`), reused. Returns the loss's metrics on every
    stage. Collective over the pp group."""
    from megatron_omni.trainer.bagel import window_kl, window_transitions
    from megatron_omni.trainer.bagel_objectives import window_policy_loss

    caches = text_caches(model, groups, traj) if forward is None else forward.caches
    ref_vs = None
    if beta > 0:
        if reference is None:
            raise ValueError("beta > 0 needs the reference model")
        with reference() as ref:
            ref_vs = branch_velocities(ref, groups, traj, markers, caches)
    vs = branch_velocities(model, groups, traj, markers, caches) if forward is None else forward.vs
    grads: dict[Key, torch.Tensor] = {}
    metrics = None
    if vs is not None:
        kl = None
        if ref_vs is not None:
            with torch.no_grad():
                ref_means = window_transitions(model, traj, markers, lambda i, j, text: ref_vs[i, j, text])[1]
        for v in vs.values():
            v.requires_grad_(True)
        new, means, stds = window_transitions(model, traj, markers, lambda i, j, text: vs[i, j, text])
        if ref_vs is not None:
            kl = window_kl(means, ref_means, stds)
        loss = window_policy_loss(new, means, stds, traj, old, adv, clip_range, beta, kl, old_means)
        loss.loss.backward()
        grads = {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in vs.items()}
        metrics = {k: float(v) for k, v in loss.metrics.items()}
    surrogate_backward(model, groups, traj, markers, caches, window_points(traj), grads)
    box = [metrics]
    dist.broadcast_object_list(box, src=groups.last_stage_rank, group=groups.pp)
    return box[0]


@torch.no_grad()
def nft_velocities(model: Any, groups: Any, traj: BagelTrajectory, markers: torch.Tensor,
                   points: list[Points], caches: list[Any] | None = None) -> torch.Tensor | None:
    """DiffusionNFT's guided velocities [N, J, n, p] fp32 at each sample's noised `points` (`nft_points`) under the
    pipelined model, on the last stage (None elsewhere; forward only). Collective over the pp group."""
    caches = text_caches(model, groups, traj) if caches is None else caches
    vs = branch_velocities(model, groups, traj, markers, caches, points)
    return None if vs is None else guided_velocities(traj, points, vs)


def nft_backward(model: Any, groups: Any, traj: BagelTrajectory, markers: torch.Tensor, points: list[Points],
                 loss_fn: Callable[[torch.Tensor], Any]) -> dict[str, float]:
    """Forward and backward of DiffusionNFT's loss over the noised `points` of `traj` on this rank's stage (the two
    passes of the module docstring over the points instead of the window steps): `loss_fn(v)` of the guided
    velocities [N, J, n, p] on the last stage (`BagelNftStep.loss_of`). Returns its metrics on every stage.
    Collective over the pp group."""
    caches = text_caches(model, groups, traj)
    vs = branch_velocities(model, groups, traj, markers, caches, points)
    grads: dict[Key, torch.Tensor] = {}
    metrics = None
    if vs is not None:
        for v in vs.values():
            v.requires_grad_(True)
        loss = loss_fn(guided_velocities(traj, points, vs))
        loss.loss.backward()
        grads = {k: torch.zeros_like(v) if v.grad is None else v.grad for k, v in vs.items()}
        metrics = {k: float(v) for k, v in loss.metrics.items()}
    surrogate_backward(model, groups, traj, markers, caches, points, grads)
    box = [metrics]
    dist.broadcast_object_list(box, src=groups.last_stage_rank, group=groups.pp)
    return box[0]
