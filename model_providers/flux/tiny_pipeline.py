"""Write a complete, tiny FLUX.1 pipeline folder offline, deterministically from a seed.

The folder is what `FluxPipeline.from_pretrained(folder, local_files_only=True)` loads, with the real classes of the
published FLUX.1-dev pipeline at tiny size: the `tiny` preset's `FluxTransformer2DModel` (two double-stream and two
single-stream blocks, the guidance embedding), a `CLIPTextModel` whose pooled output is the transformer's
`pooled_projection_dim`, a `T5EncoderModel` of its `joint_attention_dim`, an `AutoencoderKL` with FLUX's 16 latent
channels and 8x spatial compression (packed 2 x 2 into the transformer's 64 input channels) and FLUX.1-dev's
dynamically shifted `FlowMatchEulerDiscreteScheduler`. The tokenizers are the byte-level CLIP and character-level T5
tokenizers of the tiny SD3.5 pipeline (`model_providers.sd3.tiny_pipeline`). Nothing is downloaded.

CLI: python tools/make_tiny_pipeline.py --family flux --out /tmp/tiny-flux --seed 0
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_providers.flux.presets import preset
from model_providers.qwen_image.tiny_pipeline import write_tiny_pipeline
from model_providers.sd3.tiny_pipeline import CLIP_CONTEXT, build_clip_tokenizer, build_t5_tokenizer, tiny_t5, tiny_vae

LATENT_CHANNELS = 16  # FLUX's VAE latent channels; the transformer sees them packed 2 x 2


@dataclass(frozen=True)
class TinyFluxPipelineConfig:
    """Sizes of every component; the defaults make a folder of about 2 MB (1.9 MB of it the transformer, kept at
    64 channels: FLUX's packed latent width). The CLIP text encoder's hidden size
    is the transformer's `pooled_projection_dim` (FLUX pools CLIP's final state, unprojected), T5's `d_model` its
    `joint_attention_dim`."""

    transformer: dict[str, Any] = field(default_factory=lambda: preset("tiny"))
    clip_layers: int = 2
    t5_layers: int = 2
    t5_heads: int = 2
    t5_ff: int = 32
    vae_block_channels: tuple[int, ...] = (8, 8, 8, 8)  # four blocks: FLUX's 8x spatial compression

    def transformer_config(self) -> dict[str, Any]:
        """The transformer's diffusers config."""
        return dict(self.transformer)


def build_components(cfg: TinyFluxPipelineConfig, seed: int) -> dict:
    """Every pipeline component, weights drawn from `seed` (one seeded stream per component)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    t = cfg.transformer_config()
    if t["in_channels"] != 4 * LATENT_CHANNELS or (t.get("out_channels") or t["in_channels"]) != t["in_channels"]:
        raise ValueError(f"in/out channels must be 4 x the VAE's {LATENT_CHANNELS} latent channels (packed 2 x 2)")
    joint, pooled = t["joint_attention_dim"], t["pooled_projection_dim"]
    if joint % cfg.t5_heads:
        raise ValueError(f"joint_attention_dim {joint} is not divisible by {cfg.t5_heads} T5 heads")
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    eos, bos = clip_tok.convert_tokens_to_ids("<|endoftext|>"), clip_tok.convert_tokens_to_ids("<|startoftext|>")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(**t).eval()
        torch.manual_seed(seed + 1)
        # FLUX.1's published latent normalisation (vae/config.json)
        vae = tiny_vae(LATENT_CHANNELS, cfg.vae_block_channels, scaling_factor=0.3611, shift_factor=0.1159)
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=pooled, intermediate_size=2 * pooled,
            num_hidden_layers=cfg.clip_layers,
            num_attention_heads=2, max_position_embeddings=CLIP_CONTEXT, eos_token_id=eos, bos_token_id=bos,
            pad_token_id=eos,
        )).eval()
        torch.manual_seed(seed + 3)
        text_encoder_2 = tiny_t5(t5_tok, joint, cfg.t5_heads, cfg.t5_ff, cfg.t5_layers)
    # FLUX.1-dev's scheduler/scheduler_config.json: the resolution-dependent (dynamic, exponential) shift.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler, "text_encoder": text_encoder,
            "tokenizer": clip_tok, "text_encoder_2": text_encoder_2, "tokenizer_2": t5_tok}


def make_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, config: TinyFluxPipelineConfig | None = None,
                       overwrite: bool = False) -> Path:
    """Write the pipeline folder to `out_dir` (built in a temp folder beside it, then renamed).

    Args:
        out_dir: destination; must not exist unless overwrite.
        seed: weights are a function of the seed only.
        config: component sizes (default: the tiny preset).
        overwrite: replace an existing folder.

    Returns:
        The folder's path.
    """
    from diffusers import FluxPipeline

    cfg = config or TinyFluxPipelineConfig()
    return write_tiny_pipeline(out_dir, lambda: FluxPipeline(**build_components(cfg, seed)), seed, asdict(cfg),
                               overwrite)
