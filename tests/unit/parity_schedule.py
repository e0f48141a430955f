"""The Megatron side of the families' parity checks against diffusers, shared by their parity tests (Qwen-Image, Wan,
SD3.5, FLUX.1): a weighted forward/backward at any layout (Megatron-Core's 1F1B schedule at pp > 1, as
`trainer.pipeline_step` runs it) and the gradients reduced as finalize_model_grads reduces them in training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

QK_NORMS = ("q_layernorm", "k_layernorm")


def weighted_backward(model: torch.nn.Module, groups: Any, batches: Sequence[Any],
                      forward: Callable[[torch.nn.Module, Any], torch.Tensor],
                      loss: Callable[[torch.Tensor, Any], torch.Tensor], seq_length: int,
                      micro_batch_size: int) -> list[torch.Tensor]:
    """Run `forward(module, batch)` and the backward of `loss(output, batch)` (a scalar) over `batches`: at pp 1 the
    first batch only, at pp > 1 every batch as a micro-batch of Megatron-Core's 1F1B schedule (`seq_length`,
    `micro_batch_size`: its p2p tensor shape [seq_length, micro_batch_size, h]). Returns the last stage's outputs
    (detached; none on an earlier stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    pp = groups.layout.pp
    outs: list[torch.Tensor] = []
    if pp == 1:
        out = forward(model, batches[0])
        loss(out, batches[0]).backward()
        return [out.detach()]

    def forward_step(data_iterator, module):
        b = next(data_iterator)
        out = forward(module, b)

        def loss_func(output):
            outs.append(output.detach().clone())
            return loss(output, b), {}

        return out, loss_func

    get_forward_backward_func(pp_size=pp, vp_size=None)(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
        seq_length=seq_length, micro_batch_size=micro_batch_size,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=model.config), pg_collection=groups.mcore)
    return outs


def reduced_grads(model: torch.nn.Module, groups: Any, tp_replicated: Sequence[str] = QK_NORMS) -> dict[str, Any]:
    """{parameter name: gradient} of this rank, reduced as finalize_model_grads does: summed over cp, over tp for
    the replicated parameters whose names contain one of `tp_replicated` (the per-head QK norms), over pp for the
    ones every stage holds (`pipeline_parallel`)."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.clone()
        if groups.layout.cp > 1:
            dist.all_reduce(g, group=groups.cp)
        if groups.layout.tp > 1 and any(k in name for k in tp_replicated):
            dist.all_reduce(g, group=groups.tp)
        if groups.layout.pp > 1 and getattr(p, "pipeline_parallel", False):
            dist.all_reduce(g, group=groups.pp)
        grads[name] = g
    return grads
