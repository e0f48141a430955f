"""BAGEL sizes, as the three config files of a published BAGEL folder: `llm_config.json` (a Qwen2 config plus
`qk_norm` / `layer_module`), `vit_config.json` (SigLIP) and `config.json` (BAGEL's own keys), plus the VAE's
parameters (`ae.safetensors` holds FLUX's autoencoder) and the special token ids the generation step uses.

`7b-mot` is ByteDance-Seed/BAGEL-7B-MoT:
- `llm_config`: its published `llm_config.json` (the Qwen2.5-7B-Instruct architecture: 28 layers, width 3584,
  FFN 18944, 28 heads in 4 query groups, vocabulary 152064, RoPE theta 1e6, eps 1e-6). vLLM-Omni's loader
  (`pipeline_bagel.py`) forces `qk_norm=True`, `tie_word_embeddings=False`, `layer_module="Qwen2MoTDecoderLayer"`,
  and so do we;
- `vit_config`: its published `vit_config.json` (SigLIP so400m-patch14: width 1152, FFN 4304, 16 heads, 27 layers
  of which BAGEL uses 26: vLLM-Omni's loader trims the last, patch 14, image 980 = 70 patches per side);
- `bagel`: BAGEL's inference settings as its repo's inference code and vLLM-Omni's pipeline use them: latent
  patch 2 over the FLUX VAE (downsample 8, 16 channels), `max_latent_size` 64 (the inference value; the position
  table in `ema.safetensors` is 64 x 64), ViT 70 patches per side, connector GELU-tanh, timestep shift 3.0 (t2i);
- the special tokens: Qwen2.5's `<|im_start|>` (151644, BAGEL's bos), `<|im_end|>` (151645, eos) and the
  `<|vision_start|>` / `<|vision_end|>` ids (151652 / 151653) that BAGEL's `add_special_tokens` resolves as
  start/end of image.

`tiny` is for CPU tests: the same structure at width 64, 2 layers (pp=2 gives one per stage), 4 heads in 2 query
groups (tp=2 splits them), a 128-token vocabulary, a 4-channel FLUX-layout VAE with 32 channels (GroupNorm's 32
groups) and a 32 x 32 latent table (512 px: vLLM-Omni's engine warms up at 512 x 512 and refuses a BAGEL whose
table is smaller; the table is fixed sin-cos, so a position's entry is the same at any table size).
"""

from __future__ import annotations

import copy
from typing import Any

BAGEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        llm_config=dict(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=False, hidden_act="silu", qk_norm=True, layer_module="Qwen2MoTDecoderLayer",
            architectures=["Qwen2MoTForCausalLM"], model_type="qwen2",
        ),
        vit_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_channels=3,
            image_size=56, patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
            model_type="siglip_vision_model",
        ),
        bagel=dict(
            visual_gen=True, visual_und=True, latent_patch_size=2, max_latent_size=32, vit_max_num_patch_per_side=4,
            connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=3.0,
            vae_config=dict(downsample=8, z_channels=4),
        ),
        ae=dict(resolution=64, in_channels=3, downsample=8, ch=32, out_ch=3, ch_mult=[1, 1, 1, 1], num_res_blocks=1,
                z_channels=4, scale_factor=0.3611, shift_factor=0.1159),
        tokens=dict(bos_token_id=1, eos_token_id=2, start_of_image=3, end_of_image=4),
    ),
    "7b-mot": dict(
        llm_config=dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", qk_norm=True,
            layer_module="Qwen2MoTDecoderLayer", architectures=["Qwen2MoTForCausalLM"], model_type="qwen2",
        ),
        vit_config=dict(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, num_channels=3,
            image_size=980, patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
            model_type="siglip_vision_model",
        ),
        bagel=dict(
            visual_gen=True, visual_und=True, latent_patch_size=2, max_latent_size=64, vit_max_num_patch_per_side=70,
            connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=3.0,
            vae_config=dict(downsample=8, z_channels=16),
        ),
        ae=dict(resolution=256, in_channels=3, downsample=8, ch=128, out_ch=3, ch_mult=[1, 2, 4, 4], num_res_blocks=2,
                z_channels=16, scale_factor=0.3611, shift_factor=0.1159),
        tokens=dict(bos_token_id=151644, eos_token_id=151645, start_of_image=151652, end_of_image=151653),
    ),
}


def bagel_preset(name: str) -> dict[str, Any]:
    """A deep copy of BAGEL preset `name` ('tiny', '7b-mot')."""
    if name not in BAGEL_PRESETS:
        raise KeyError(f"unknown BAGEL preset {name!r}; known: {sorted(BAGEL_PRESETS)}")
    return copy.deepcopy(BAGEL_PRESETS[name])
