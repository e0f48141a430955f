"""Configuration of an MMDiT (dual-stream diffusion transformer) as a Megatron-Core `TransformerConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MMDiTConfig(TransformerConfig):
    """`TransformerConfig` plus the fields an MMDiT needs.

    hidden_size = num_attention_heads * kv_channels is the joint width of both streams; the text stream
    enters with `joint_attention_dim` channels, the image stream with `in_channels` (packed 2x2 latent
    patches) and leaves with `patch_size**2 * out_channels`.
    """

    in_channels: int = 64
    out_channels: int = 16
    patch_size: int = 2
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 10000.0
    timestep_channels: int = 256
    norm_eps: float = 1e-6
    # Context parallelism inside the model is (ulysses x ring); Megatron's own `context_parallel_size`
    # stays 1 because its attention would ask for TransformerEngine.
    ulysses_size: int = 1
    ring_size: int = 1
    # The timestep embedder is replicated on every pipeline stage; Megatron-Core's finalize_model_grads
    # all-reduces the grads of parameters marked `pipeline_parallel` across stages when this is set.
    has_cond_embedder: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        head_dim = self.kv_channels
        if sum(self.axes_dims_rope) != head_dim:
            raise ValueError(
                f"axes_dims_rope {tuple(self.axes_dims_rope)} must sum to the head dim {head_dim}"
            )
        if any(a % 2 for a in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {tuple(self.axes_dims_rope)} must all be even")
