"""Configurations of the DiTs as Megatron-Core `TransformerConfig`s: the MMDiT (dual-stream, Qwen-Image) and the
Wan video DiT (one stream of video tokens with cross-attention to the text)."""

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
    # Qwen-Image-Edit-2511: conditioning-image tokens are modulated with the timestep-0 embedding (diffusers'
    # `zero_cond_t`); the generated tokens and the text with the sample's timestep.
    zero_cond_t: bool = False
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


@dataclass
class WanConfig(TransformerConfig):
    """`TransformerConfig` plus the fields diffusers' `WanTransformer3DModel` has.

    hidden_size = num_attention_heads * kv_channels; ffn_hidden_size is diffusers' `ffn_dim`. The video enters
    as packed 3D patches of `in_channels * prod(patch_size)` channels (ordered channel, then the patch's
    frame, row, column: Conv3d's weight layout) and leaves packed the same way with `out_channels`. The text
    enters with `text_dim` channels; the cross-attention's input is LayerNorm'd with affine weights (diffusers'
    `cross_attn_norm=True`, what every published Wan uses). RoPE splits each head's dim over (frames, rows,
    columns) as diffusers does: rows and columns `2 * (kv_channels // 6)` each, frames the rest.
    """

    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    freq_dim: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_max_seq_len: int = 1024
    # Context parallelism is (ulysses x ring) over the video tokens, as for the MMDiT.
    ulysses_size: int = 1
    ring_size: int = 1
    # The timestep embedder and projection are replicated on every pipeline stage (grads summed over stages).
    has_cond_embedder: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(tuple(self.patch_size)) != 3:
            raise ValueError(f"patch_size {self.patch_size} must be (frames, height, width)")
        if self.kv_channels < 6 or self.kv_channels % 2:
            raise ValueError(f"head dim {self.kv_channels} must be even and >= 6 (3D RoPE)")
        if self.qk_layernorm:
            # Wan's QK norms span all heads (their weights split over tp like the heads); Megatron's
            # finalize_model_grads would sum the grads of parameters named q_layernorm/k_layernorm over tp.
            raise ValueError("WanConfig: qk_layernorm must stay False (Wan normalises q/k across heads)")

    @property
    def rope_axes_dims(self) -> tuple[int, int, int]:
        """Head-dim channels per RoPE axis (frames, rows, columns), as diffusers' `WanRotaryPosEmbed`."""
        d = self.kv_channels
        hw = 2 * (d // 6)
        return (d - 2 * hw, hw, hw)

    @property
    def patch_channels(self) -> int:
        """Channels of one packed input token: in_channels x the patch's volume."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw
