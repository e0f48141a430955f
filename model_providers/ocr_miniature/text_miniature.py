"""The OCR miniature's pipeline architecture: a tiny Qwen-Image pipeline sized to learn to write on a CPU.

- Transformer: 6 MMDiT blocks of width 128 (4 heads x 32), about 3.7M parameters: the size
  that was measured learning legible words in about half an hour on 2 cores (pixel space, 64 tokens).
- VAE: `AutoencoderKLQwenImage` with two downsampling stages (scale 4, not Qwen-Image's 8) and 16 latent
  channels, trained by `tools/pretrain_tiny_text.py`. A 64 px image becomes a 16 x 16 x 16 latent, packed
  2 x 2 into 64 tokens of 64 channels: 3 RGB values per latent value, a compression a small VAE learns in
  minutes without blurring 10 px glyphs, and the same 64 image tokens the measured pixel-space model had.
- Text encoder: a tiny Qwen2.5-VL over a byte-level tokenizer, so each character of the word is its own
  token; random from the seed and frozen (`tools/pretrain_tiny_text.py --text-encoder train` trains it with
  the transformer instead). RL keeps it frozen, as for the 20B model. The tokenizer merges the prompt
  template's words so that QwenImagePipeline's fixed drop of 34 template tokens removes exactly the system
  prompt (the real Qwen tokenizer's count); the conditioning is then the user prompt plus the 5 closing
  tokens, not ~120 leftover template bytes.
"""

from __future__ import annotations

from model_providers.qwen_image.tiny_pipeline import TinyPipelineConfig, TinyTransformerConfig

# The words of QwenImagePipeline's prompt template (byte-level words; a leading space belongs to the word).
TEMPLATE_WORDS: tuple[str, ...] = (
    "system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color", " shape",
    " size", " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
    " background",
)

MINIATURE = TinyPipelineConfig(
    transformer=TinyTransformerConfig(
        num_layers=6, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
        patch_size=2, in_channels=64, out_channels=16,
    ),
    text_hidden_size=64,
    text_layers=2,
    text_heads=2,
    text_intermediate_size=128,
    vae_base_dim=16,
    vae_dim_mult=(1, 2, 2),
    vae_num_res_blocks=1,
    merged_words=TEMPLATE_WORDS,
)
