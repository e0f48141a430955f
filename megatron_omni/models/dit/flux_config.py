"""FLUX.1's transformer configuration as a Megatron-Core `TransformerConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class FluxConfig(TransformerConfig):
    """`TransformerConfig` plus the fields of diffusers' `FluxTransformer2DModel`.

    `num_layers` is diffusers' `num_layers` (the double-stream blocks); `num_single_layers` the single-stream
    blocks after them. hidden_size = num_attention_heads * kv_channels; ffn_hidden_size = 4 * hidden (both block
    kinds' MLP width). Latents enter as FLUX's packed 2x2 patches (`in_channels` = 4 x the VAE's 16 channels,
    `patch_size` 1: nothing more is patched), prompts with `joint_attention_dim` channels (T5), the pooled CLIP
    embedding with `pooled_projection_dim`; `guidance_embeds`: the guidance-distilled model (FLUX.1-dev) takes the
    guidance scale as a second timestep-like input. RoPE splits each head over `axes_dims_rope` (FluxPosEmbed's
    3 axes: a constant 0 for every token, rows, columns; text tokens sit at position 0 on all three).
    """

    num_single_layers: int = 38
    in_channels: int = 64
    out_channels: int = 64
    patch_size: int = 1
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    rope_theta: float = 10000.0
    timestep_channels: int = 256
    norm_eps: float = 1e-6
    # The context-parallel split of the image tokens (Ulysses x ring), as `MMDiTConfig` has it.
    ulysses_size: int = 1
    ring_size: int = 1
    has_cond_embedder: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if sum(self.axes_dims_rope) != self.kv_channels:
            raise ValueError(f"axes_dims_rope {tuple(self.axes_dims_rope)} must sum to the head dim {self.kv_channels}")
        if any(a % 2 for a in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {tuple(self.axes_dims_rope)} must all be even")
        if self.num_single_layers < 0:
            raise ValueError(f"num_single_layers must be >= 0, got {self.num_single_layers}")
