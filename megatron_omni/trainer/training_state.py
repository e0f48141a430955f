"""The Megatron-Core training state of one rank: DDP around the model, the optimizer, and what they allocate.

`build_ddp_and_optimizer` is how every trainer wraps its model (Megatron-LM's choices): grads reduced in fp32
into DDP's contiguous buffers; Adam through `get_megatron_optimizer`, which for bf16 parameters keeps fp32 main
parameters and fp32 Adam moments (`OptimizerConfig(bf16=True)`), sharded over data parallel with the
distributed optimizer. `allocated_bytes` counts the bytes those objects really hold, by storage, so the
dry-run planner's memory formula can be checked against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam's settings (the trainer's `optim` config carries them)."""

    lr: float
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = False


def build_ddp_and_optimizer(model: torch.nn.Module, config: Any, pg_collection: Any, settings: OptimizerSettings,
                            config_overrides: dict | None = None) -> tuple[DistributedDataParallel, Any]:
    """(DDP-wrapped model, Megatron optimizer) for `model` built from the TransformerConfig `config` (its
    `params_dtype` decides mixed precision: bf16 parameters get fp32 main parameters and Adam state).
    `config_overrides`: Megatron-Core's per-parameter-group overrides ({ParamKey: {"max_lr": ...}}), e.g. a
    parameter group with its own learning rate."""
    bf16 = config.params_dtype == torch.bfloat16
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=settings.distributed_optimizer),
        module=model,
        pg_collection=pg_collection,
    )
    s = settings
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=s.lr, min_lr=s.lr, weight_decay=s.weight_decay,
                        adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2, adam_eps=s.adam_eps,
                        clip_grad=s.clip_grad, bf16=bf16, params_dtype=config.params_dtype,
                        main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                        use_distributed_optimizer=s.distributed_optimizer),
        [ddp], config_overrides=config_overrides, use_gloo_process_groups=False, pg_collection=pg_collection,
    )
    return ddp, optimizer


def _storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the storages behind `tensors` (views of one buffer count once)."""
    out: dict[int, int] = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def allocated_bytes(ddp: DistributedDataParallel, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds, by what holds them: `parameters` (the model's weights, DDP's contiguous
    parameter buffer when it has one), `gradients` (DDP's main-grad buffers), `optimizer_states` (main
    parameters that are not the model's own storage, and every optimizer state tensor: Adam's m and v).
    Call after one optimizer step (torch Adam creates its state lazily)."""
    params = _storages(ddp.module.parameters())
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    params |= _storages(b.param_data for b in buffers if b.param_data is not None)
    grads = {k: v for k, v in _storages(b.grad_data for b in buffers).items() if k not in params}
    optim_tensors = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            optim_tensors += list(group["params"])
        for state in inner.state.values():
            optim_tensors += [v for v in state.values() if torch.is_tensor(v)]
    seen = params.keys() | grads.keys()
    states = {k: v for k, v in _storages(optim_tensors).items() if k not in seen}
    return {"parameters": sum(params.values()), "gradients": sum(grads.values()),
            "optimizer_states": sum(states.values())}


def build_scheduler(optimizer: Any, lr: float, weight_decay: float, warmup_steps: int = 0,
                    total_updates: int = 1) -> OptimizerParamScheduler:
    """Megatron-Core's scheduler: linear warmup from 0 over `warmup_steps` updates (none: start at `lr`), then
    a constant lr and weight decay. It applies each parameter group's own max_lr, so an override's lr stays."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(total_updates, warmup_steps + 1),
        lr_decay_style="constant", start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=total_updates, wd_incr_style="constant",
    )
