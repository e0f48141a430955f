"""Megatron-Core's tensor-parallel linears with a direct path for a layer that is not split.

At tensor-parallel size 1 without sequence parallelism, Megatron-Core's `ColumnParallelLinear` and
`RowParallelLinear` still send every call through identity autograd Functions (copy to / reduce from the
tp region), a Python autograd Function around the matmul, and a separate bias add. On the small DiT on
CPU that costs about 4% of a training forward+backward (`benchmarks/train_step.py` measures the step).
These subclasses call `F.linear` (one fused GEMM + bias, C++ autograd) in exactly that case and keep
Megatron-Core's forward in every other one: tp > 1, sequence parallelism, gradient-accumulation fusion
(the GPU path that writes wgrad into `main_grad`), expert communication, deferred embedding wgrad, CPU
offloading, or a weight passed in. Parameters, their tensor-parallel attributes, sharded state dicts and
DDP's gradient hooks stay Megatron-Core's, so checkpoints and optimizers see the same module.

Split over tp > 1 (without those features) they round like the unsplit layer, so a bf16 trainer at TP=2
recomputes the log-probs a bf16 rollout engine (one unsplit GEMM per linear) recorded: the column-parallel
layer runs one fused GEMM + bias between Megatron-Core's own tp collectives, the row-parallel layer sums its
half-precision partial products in fp32 and rounds once after the bias (Megatron-Core rounds the partial
sums, all-reduces in bf16 and adds the bias after). Measured on the tiny text pipeline, bf16 TP=2 mean
|dlogp| 3.3e-5 -> 7.6e-6 (no CFG), 8.6e-5 -> 1.1e-5 (CFG); the fp32 row-parallel GEMM costs the time of an
fp32 (TF32 on GPU) matmul for half the block's linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.utils import get_pg_size


def runs_unsplit(layer: tensor_parallel.ColumnParallelLinear | tensor_parallel.RowParallelLinear) -> bool:
    """Whether Megatron-Core's forward of `layer` reduces to one plain linear (what `direct` caches)."""
    return (
        get_pg_size(layer.tp_group) == 1
        and not layer.sequence_parallel
        and not layer.gradient_accumulation_fusion
        and not layer.explicit_expert_comm
        and not layer.config.defer_embedding_wgrad_compute
    )


def runs_split_plainly(layer) -> bool:
    """Whether `layer` is split over tp > 1 with nothing but the tp collectives around its matmul (what
    `split` caches): no sequence parallelism, wgrad fusion, expert communication or deferred wgrad."""
    return (
        get_pg_size(layer.tp_group) > 1
        and not layer.sequence_parallel
        and not layer.gradient_accumulation_fusion
        and not layer.explicit_expert_comm
        and not layer.config.defer_embedding_wgrad_compute
    )


def _direct(layer, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if layer.skip_bias_add else layer.bias
    return F.linear(input_, layer.weight, bias), (layer.bias if layer.skip_bias_add else None)


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """Megatron-Core's ColumnParallelLinear; `F.linear` when the layer is not split (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.direct = runs_unsplit(self)
        self.split = runs_split_plainly(self)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ [s, b, in] -> (output [s, b, out], bias when skip_bias_add else None)."""
        if weight is None and self.config._cpu_offloading_context is None:
            if self.direct:
                return _direct(self, input_)
            if self.split:
                # One fused GEMM + bias, rounded once, as the unsplit layer (and diffusers) computes each
                # output; Megatron-Core's path adds the bias after the rounded GEMM.
                x = tensor_parallel.copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
                out, extra = _direct(self, x)
                gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
                if gather:
                    out = tensor_parallel.gather_from_tensor_model_parallel_region(out, group=self.tp_group)
                return out, extra
        return super().forward(input_, weight, runtime_gather_output)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """Megatron-Core's RowParallelLinear; `F.linear` when the layer is not split (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.direct = runs_unsplit(self)
        self.split = runs_split_plainly(self)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ [s, b, in] -> (output [s, b, out], bias when skip_bias_add else None)."""
        if self.config._cpu_offloading_context is None:
            if self.direct:
                return _direct(self, input_)
            if self.split and self.input_is_parallel:
                # Half-precision partial sums are summed in fp32 and rounded once, as the unsplit GEMM
                # accumulates; Megatron-Core rounds each rank's partial sum, all-reduces in bf16 and adds the
                # bias after, three roundings the rollout's unsplit layer does not make.
                half = input_.dtype in (torch.float16, torch.bfloat16)
                partial = F.linear(input_.float(), self.weight.float()) if half else F.linear(input_, self.weight)
                out = tensor_parallel.reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
                if self.bias is not None and not self.skip_bias_add:
                    out = out + self.bias.to(out.dtype)
                return out.to(input_.dtype), (self.bias if self.skip_bias_add else None)
        return super().forward(input_)
