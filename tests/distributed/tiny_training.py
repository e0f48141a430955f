"""A tiny Qwen-Image Megatron model with Megatron's DDP, Adam and lr scheduler, for the checkpoint and
optimizer tests (built on each rank inside `run_ranks`)."""

from __future__ import annotations

import torch
from diffusers import QwenImageTransformer2DModel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from model_providers.qwen_image import provider


def build_tiny_training(tp: int, distributed: bool, init_seed: int, warmup_steps: int = 0):
    """-> (groups, model, ddp, optimizer, scheduler) at `tp` (dp = the rest of the world), weights drawn from
    `init_seed` (N(0, 0.2) everywhere: diffusers starts adaLN at zero, which would leave params without
    grads), Adam lr 1e-3 with `warmup_steps` of linear warm-up."""
    groups = build_parallel_groups(ParallelLayout(tp=tp))
    seed_everything(0, tp_rank=groups.tp.rank())
    cfg = provider.transformer_config("tiny", tp=tp)
    model = provider.build_model(cfg, groups)
    torch.manual_seed(init_seed)
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    provider.load_hf_state_dict(model, ref.state_dict())
    ddp = DistributedDataParallel(
        config=cfg, module=model, pg_collection=groups.mcore,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=distributed),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, params_dtype=torch.float32,
                        use_distributed_optimizer=distributed),
        [ddp], use_gloo_process_groups=False, pg_collection=groups.mcore,
    )
    sched = OptimizerParamScheduler(opt, init_lr=0.0 if warmup_steps else 1e-3, max_lr=1e-3, min_lr=1e-3,
                                    lr_warmup_steps=warmup_steps, lr_decay_steps=10, lr_decay_style="constant",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant")
    return groups, model, ddp, opt, sched
