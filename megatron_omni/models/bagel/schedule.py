"""BAGEL's generation step under Megatron-Core's pipeline schedules: forward and backward of a loss of the
velocity over micro-batches, 1F1B at pp > 1 (`get_forward_backward_func`), the no-pipelining schedule at pp 1.

A micro-batch is one generation step of one image: latents [n, p] at timesteps [n] with their latent position
ids [n], conditioned on a prompt's text KV that every stage already holds for its own layers (`stage_text`, run
before, without autograd: the understanding expert is frozen). Between stages travel the image query's hidden
states [n + 2, 1, h] (the two image markers and the n latent tokens: the schedule's `seq_length` n + 2 with
micro-batch size 1); the last stage's output is the velocity [n, p] and `loss_fn` turns it into the micro-batch's
loss. Megatron's schedule divides each micro-batch's loss by the number of micro-batches (the gradients are those
of the mean loss) and runs the backward through the stages over p2p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_omni.models.bagel.mot import KV


def velocity_forward_backward(model, groups, text_kv: list[KV], prompt_len: int, markers: torch.Tensor,
                              steps: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                              loss_fn: Callable[[int, torch.Tensor], torch.Tensor],
                              forward_only: bool = False) -> list[dict]:
    """Forward (and, unless `forward_only`, backward: grads accumulate in the parameters' `.grad` or DDP buffers)
    of `loss_fn(i, velocity [n, p])` over the micro-batches `steps[i] = (latents [n, p], timesteps [n],
    latent_pos_ids [n])` of one image size, on this rank's `BagelMoT` stage (`groups`: its ParallelGroups; the
    model's config has `pipeline_dtype` and `batch_p2p_comm=False` on gloo). Returns the last stage's per
    micro-batch `{"loss": ...}` (empty elsewhere). Collective over the pp group."""
    pp = groups.layout.pp
    n = steps[0][0].shape[0]
    if any(s[0].shape[0] != n for s in steps):
        raise ValueError(f"micro-batches of one schedule call must share one image size; got "
                         f"{sorted({s[0].shape[0] for s in steps})} latent tokens")
    schedule = get_forward_backward_func(pp_size=pp, vp_size=None)
    p2p = P2PCommunicator(pp_group=groups.pp, config=model.config) if pp > 1 else None

    def forward_step(data_iterator, module):
        i, (latents, timesteps, pos) = next(data_iterator)
        hidden = None if module.pre_process else module.input_tensor
        out = module.stage_velocity(text_kv, prompt_len, markers, latents, timesteps, pos, hidden)

        def loss(output: torch.Tensor):
            value = loss_fn(i, output)
            return value, {"loss": value.detach()}

        return out, loss

    return schedule(forward_step_func=forward_step, data_iterator=iter(list(enumerate(steps))), model=[model],
                    num_microbatches=len(steps), seq_length=n + 2, micro_batch_size=1, forward_only=forward_only,
                    p2p_communicator=p2p, pg_collection=groups.mcore)
