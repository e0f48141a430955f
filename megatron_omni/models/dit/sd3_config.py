"""The SD3 / SD3.5 MMDiT's configuration as a Megatron-Core `TransformerConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class SD3Config(TransformerConfig):
    """`TransformerConfig` plus the fields of diffusers' `SD3Transformer2DModel`.

    hidden_size = num_attention_heads * kv_channels (diffusers' inner_dim; its `caption_projection_dim` must
    equal it). Latents enter as images [b, in_channels, H, W] and are patch-embedded (a `patch_size` stride
    convolution plus the centre crop of a `pos_embed_max_size`^2 2-D sincos table); prompts enter with
    `joint_attention_dim` channels, the pooled CLIP embedding with `pooled_projection_dim`.
    `dual_attention_layers`: 0-based blocks with the second, image-only attention (SD3.5-M: 0..12).
    """

    in_channels: int = 16
    out_channels: int = 16
    patch_size: int = 2
    sample_size: int = 128
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 2048
    pos_embed_max_size: int = 96
    dual_attention_layers: tuple[int, ...] = ()
    timestep_channels: int = 256
    norm_eps: float = 1e-6
    # The context-parallel split of the image tokens (Ulysses x ring), as `MMDiTConfig` has it.
    ulysses_size: int = 1
    ring_size: int = 1
    has_cond_embedder: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dual_attention_layers {bad} are not blocks of a {self.num_layers}-block model")
        if self.num_layers - 1 in tuple(self.dual_attention_layers):
            raise ValueError("the last (context-pre-only) block cannot be a dual-attention block")
