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


def _direct(layer, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = None if layer.skip_bias_add else layer.bias
    return F.linear(input_, layer.weight, bias), (layer.bias if layer.skip_bias_add else None)


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """Megatron-Core's ColumnParallelLinear; `F.linear` when the layer is not split (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.direct = runs_unsplit(self)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ [s, b, in] -> (output [s, b, out], bias when skip_bias_add else None)."""
        if self.direct and weight is None and self.config._cpu_offloading_context is None:
            return _direct(self, input_)
        return super().forward(input_, weight, runtime_gather_output)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """Megatron-Core's RowParallelLinear; `F.linear` when the layer is not split (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.direct = runs_unsplit(self)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ [s, b, in] -> (output [s, b, out], bias when skip_bias_add else None)."""
        if self.direct and self.config._cpu_offloading_context is None:
            return _direct(self, input_)
        return super().forward(input_)
