"""Write a complete, tiny Wan text-to-video pipeline folder offline, deterministically from a seed (or, with
`TINY_TI2V`, a tiny folder in Wan2.2-TI2V-5B's layout).

The folder is what `WanPipeline.from_pretrained(folder, local_files_only=True)` loads: the `tiny` preset's
`WanTransformer3DModel`, a tiny `AutoencoderKLWan` (4 latent channels, Wan's 4 x 8 x 8 compression), a tiny
`UMT5EncoderModel` text encoder, the byte-level tokenizer of the tiny Qwen-Image pipeline (256 byte symbols
plus special tokens; Wan's pipeline only needs a tokenizer that pads) and a `FlowMatchEulerDiscreteScheduler`
with a static shift. Nothing is downloaded.

The TI2V layout (`TINY_TI2V`, `--family wan-ti2v`) is what Wan-AI's Wan2.2-TI2V-5B diffusers folder holds, at
tiny size: `WanPipeline` with `expand_timesteps=True` (per-token timesteps; `WanImageToVideoPipeline` loads the same
folder and conditions on the first frame), a transformer of 48 latent channels and Wan2.2's residual VAE
(`is_residual`, 12-channel 2 x 2 pixel patches, 48 latent channels: 4 x 16 x 16 compression).

The A14B layout (`TINY_A14B`, `--family wan-a14b`) is what Wan-AI's Wan2.2-T2V-A14B diffusers folder holds, at tiny
size: `WanPipeline` with two transformers (`transformer`, the high-noise expert; `transformer_2`, the low-noise one)
and `boundary_ratio` in model_index.json (`model_providers.wan.experts`).

CLI: python tools/make_tiny_pipeline.py --family wan --out /tmp/tiny-wan --seed 0
     python tools/make_tiny_pipeline.py --family wan-a14b --out /tmp/tiny-wan-a14b --seed 0
     python tools/make_tiny_pipeline.py --family wan-ti2v --out /tmp/tiny-wan-ti2v --seed 0
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_providers.qwen_image.tiny_pipeline import build_tokenizer, write_tiny_pipeline
from model_providers.wan.presets import preset


@dataclass(frozen=True)
class TinyWanPipelineConfig:
    """Sizes of every component; the defaults make a folder of about 1 MB."""

    transformer: dict[str, Any] = field(default_factory=lambda: preset("tiny"))
    text_layers: int = 2
    text_heads: int = 4
    text_ff: int = 64
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 1, 2, 2)
    vae_num_res_blocks: int = 1
    shift: float = 3.0  # Wan's flow shift at 480p
    # Wan2.2-TI2V's layout: per-token timesteps in the pipeline, the residual VAE with 2 x 2 pixel patches
    expand_timesteps: bool = False
    vae_residual: bool = False
    vae_patch_size: int | None = None
    # Wan2.2-A14B's layout: a second transformer (`transformer_2`, the low-noise expert, its own seeded weights)
    # switched to below boundary_ratio x the scheduler's training timesteps
    boundary_ratio: float | None = None

    def transformer_config(self) -> dict[str, Any]:
        """The transformer's diffusers config."""
        return dict(self.transformer)


def build_components(cfg: TinyWanPipelineConfig, seed: int) -> dict:
    """All five pipeline components, weights drawn from `seed` (one seeded stream per component)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    t = cfg.transformer_config()
    z_dim = t["in_channels"]
    if t["out_channels"] != z_dim:
        raise ValueError(f"in_channels {z_dim} and out_channels {t['out_channels']} must both be the VAE's z_dim")
    if t["text_dim"] % cfg.text_heads:
        raise ValueError(f"text_dim {t['text_dim']} is not divisible by {cfg.text_heads} text heads")
    tokenizer = build_tokenizer()
    # Wan2.2's VAE patchifies pixels 2 x 2 (3 -> 12 channels) before its encoder and its decoder's residual
    # up-sampling undoes it
    p = cfg.vae_patch_size
    vae_layout = {} if p is None else dict(is_residual=cfg.vae_residual, in_channels=3 * p * p,
                                           out_channels=3 * p * p, patch_size=p)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(**t).eval()
        torch.manual_seed(seed + 1)
        g = torch.Generator().manual_seed(seed + 2)
        vae = AutoencoderKLWan(
            base_dim=cfg.vae_base_dim,
            z_dim=z_dim,
            dim_mult=list(cfg.vae_dim_mult),
            num_res_blocks=cfg.vae_num_res_blocks,
            # one entry per downsampling stage: two temporal halvings (x4) and three spatial ones (x8), as Wan's
            temperal_downsample=[False] + [True] * (len(cfg.vae_dim_mult) - 2),
            latents_mean=[round(float(x), 4) for x in 0.1 * torch.randn(z_dim, generator=g)],
            latents_std=[round(float(x), 4) for x in 1.0 + 0.5 * torch.rand(z_dim, generator=g)],
            scale_factor_temporal=2 ** (len(cfg.vae_dim_mult) - 2),
            scale_factor_spatial=2 ** (len(cfg.vae_dim_mult) - 1) * (cfg.vae_patch_size or 1),
            **vae_layout,
        ).eval()
        torch.manual_seed(seed + 3)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=t["text_dim"], d_kv=t["text_dim"] // cfg.text_heads, d_ff=cfg.text_ff,
            num_layers=cfg.text_layers, num_heads=cfg.text_heads, relative_attention_num_buckets=8,
            relative_attention_max_distance=32, pad_token_id=tokenizer.pad_token_id,
        )).eval()
        if cfg.boundary_ratio is not None:
            torch.manual_seed(seed + 4)
            transformer_2 = WanTransformer3DModel(**t).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift)
    out = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
           "scheduler": scheduler}
    if cfg.boundary_ratio is not None:
        out.update(transformer_2=transformer_2, boundary_ratio=cfg.boundary_ratio)
    return out


def make_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, config: TinyWanPipelineConfig | None = None,
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
    from diffusers import WanPipeline

    cfg = config or TinyWanPipelineConfig()
    return write_tiny_pipeline(
        out_dir, lambda: WanPipeline(**build_components(cfg, seed), expand_timesteps=cfg.expand_timesteps), seed,
        asdict(cfg), overwrite)


# Wan2.2-TI2V-5B's layout at tiny size: 48 latent channels, the residual VAE's 16x spatial compression, expanded
# timesteps; the `tiny` transformer otherwise.
TINY_TI2V = TinyWanPipelineConfig(
    transformer=dict(preset("tiny"), in_channels=48, out_channels=48),
    expand_timesteps=True, vae_residual=True, vae_patch_size=2,
)


# Wan2.2-T2V-A14B's layout at tiny size: two `tiny` transformers (high-noise `transformer`, low-noise `transformer_2`)
# switched at its published boundary_ratio 0.875 (I2V-A14B's is 0.9); with the tiny folder's shift 3.0 a 4-step grid
# runs step 0 (t = 1000) on the high-noise expert and steps 1-3 (t = 857.7, 602.2, 8.9) on the low-noise one.
TINY_A14B = TinyWanPipelineConfig(boundary_ratio=0.875)


def make_tiny_a14b_pipeline(out_dir: str | os.PathLike, seed: int = 0, overwrite: bool = False) -> Path:
    """`make_tiny_pipeline` with `TINY_A14B`: a tiny two-expert folder in Wan2.2-A14B's layout."""
    return make_tiny_pipeline(out_dir, seed, TINY_A14B, overwrite)


def make_tiny_ti2v_pipeline(out_dir: str | os.PathLike, seed: int = 0, overwrite: bool = False) -> Path:
    """`make_tiny_pipeline` with `TINY_TI2V`: a tiny folder in Wan2.2-TI2V-5B's layout."""
    return make_tiny_pipeline(out_dir, seed, TINY_TI2V, overwrite)
