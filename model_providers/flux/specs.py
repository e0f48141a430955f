"""Layer specs of FLUX.1's blocks: `local` (Megatron-Core's linears, runs on CPU) and `te` (TransformerEngine
linears for the column/row-parallel projections on GPUs). The QK norms are torch's `nn.RMSNorm`, as diffusers'
`FluxAttention` builds them (its rounding in bf16, not diffusers' own `RMSNorm`'s)."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from megatron_omni.models.dit.flux_layer import FluxSingleSubmodules
from megatron_omni.models.dit.layer import MMDiTLayerSubmodules, MMDiTStreamSubmodules
from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear


def _linears(backend: str) -> tuple[type, type]:
    if backend == "local":
        return ColumnParallelLinear, RowParallelLinear
    if backend == "te":
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
        except ImportError as exc:
            raise ImportError(f"the 'te' layer spec needs TransformerEngine ({exc}); use backend='local'") from exc
        return TEColumnParallelLinear, TERowParallelLinear
    raise ValueError(f"unknown layer-spec backend {backend!r}; choose 'local' or 'te'")


def layer_spec(backend: str) -> tuple[MMDiTLayerSubmodules, FluxSingleSubmodules]:
    """(double-stream block spec, single-stream block spec) for `backend` ('local' or 'te'). The linears that
    gather their output (adaLN, the single block's output projection) stay Megatron-Core's."""
    column, row = _linears(backend)
    norm = ModuleSpec(module=nn.RMSNorm)

    def stream() -> MMDiTStreamSubmodules:
        return MMDiTStreamSubmodules(adaln=ColumnParallelLinear, linear_qkv=column, q_layernorm=norm, k_layernorm=norm,
                                     linear_proj=row, linear_fc1=column, linear_fc2=row)

    single = FluxSingleSubmodules(adaln=ColumnParallelLinear, linear_qkv=column, q_layernorm=norm, k_layernorm=norm,
                                  linear_fc1=column, linear_out=ColumnParallelLinear)
    return MMDiTLayerSubmodules(img=stream(), txt=stream()), single
