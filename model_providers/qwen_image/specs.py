"""Layer specs of the Qwen-Image MMDiT block: `local` (pure torch + Megatron-Core, runs on CPU) and `te`
(TransformerEngine linears for GPUs; FP8 can be switched on through the config later)."""

from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_omni.models.dit.layer import MMDiTLayerSubmodules, MMDiTStreamSubmodules
from megatron_omni.models.dit.norms import RMSNorm
from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear


def _stream(column, row) -> MMDiTStreamSubmodules:
    return MMDiTStreamSubmodules(
        # TE's column-parallel linear cannot gather its output; the adaLN stays a Megatron-Core linear.
        adaln=ColumnParallelLinear,
        linear_qkv=column,
        q_layernorm=ModuleSpec(module=RMSNorm),
        k_layernorm=ModuleSpec(module=RMSNorm),
        linear_proj=row,
        linear_fc1=column,
        linear_fc2=row,
    )


def local_spec() -> MMDiTLayerSubmodules:
    """Megatron-Core's own tensor-parallel linears (with the direct path of `parallel.linear` when a layer
    is not split) and our RMSNorm (diffusers' rounding order): runs anywhere, used by the tests."""
    return MMDiTLayerSubmodules(img=_stream(ColumnParallelLinear, RowParallelLinear),
                                txt=_stream(ColumnParallelLinear, RowParallelLinear))


def te_spec() -> MMDiTLayerSubmodules:
    """TransformerEngine linears (GPU). Raises ImportError with the reason when TE is not installed."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
    except ImportError as exc:
        raise ImportError(f"the 'te' layer spec needs TransformerEngine ({exc}); use backend='local'") from exc
    return MMDiTLayerSubmodules(img=_stream(TEColumnParallelLinear, TERowParallelLinear),
                                txt=_stream(TEColumnParallelLinear, TERowParallelLinear))


def layer_spec(backend: str) -> MMDiTLayerSubmodules:
    """The spec for `backend` ('local' or 'te')."""
    if backend == "local":
        return local_spec()
    if backend == "te":
        return te_spec()
    raise ValueError(f"unknown layer-spec backend {backend!r}; choose 'local' or 'te'")
