"""Layer specs of the Wan block: `local` (Megatron-Core's parallel linears, runs on CPU) and `te`
(TransformerEngine linears for GPUs)."""

from __future__ import annotations

from megatron_omni.models.dit.wan_layer import WanLayerSubmodules
from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear


def layer_spec(backend: str) -> WanLayerSubmodules:
    """The spec for `backend` ('local' or 'te'); 'te' raises ImportError with the reason when TransformerEngine
    is not installed."""
    if backend == "local":
        return WanLayerSubmodules(column=ColumnParallelLinear, row=RowParallelLinear)
    if backend == "te":
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
        except ImportError as exc:
            raise ImportError(f"the 'te' layer spec needs TransformerEngine ({exc}); use backend='local'") from exc
        return WanLayerSubmodules(column=TEColumnParallelLinear, row=TERowParallelLinear)
    raise ValueError(f"unknown layer-spec backend {backend!r}; choose 'local' or 'te'")
