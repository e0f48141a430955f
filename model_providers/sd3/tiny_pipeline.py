"""Write a complete, tiny SD3.5 pipeline folder offline, deterministically from a seed.

The folder is what `StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)` loads, with the real
classes of the published pipeline at tiny size: the `tiny` preset's `SD3Transformer2DModel` (a dual-attention
first block, a context-pre-only last block), two `CLIPTextModelWithProjection` text encoders (CLIP-L's and
CLIP-G's roles: their penultimate hidden states side by side, their projected pooled outputs concatenated into
the transformer's `pooled_projection_dim`), a `T5EncoderModel` of the transformer's `joint_attention_dim`, an
`AutoencoderKL` with SD3's 8x spatial compression, and SD3.5's `FlowMatchEulerDiscreteScheduler(shift=3.0)`.

The tokenizers are built by hand, as the tiny Qwen-Image pipeline builds its own: two byte-level `CLIPTokenizer`s
(the 256 byte symbols, each also with CLIP's `</w>` end-of-word suffix, no merges, CLIP's start/end tokens,
77-token context) and a `T5Tokenizer` whose unigram vocabulary is the printable ASCII characters plus T5's
pad/eos/unk. Nothing is downloaded.

CLI: python tools/make_tiny_pipeline.py --family sd3 --out /tmp/tiny-sd3 --seed 0
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_providers.qwen_image.tiny_pipeline import bytes_to_unicode, write_tiny_pipeline
from model_providers.sd3.presets import preset

CLIP_CONTEXT = 77  # CLIP's context length: SD3's pipeline pads both CLIP prompts to it


@dataclass(frozen=True)
class TinySD3PipelineConfig:
    """Sizes of every component; the defaults make a folder of well under 1 MB. `clip_l` / `clip_g` are (hidden
    size, projection size) of the two CLIP text encoders: their hidden sizes sum to at most the transformer's
    `joint_attention_dim` (the pipeline zero-pads the CLIP states to the T5 width) and their projections to its
    `pooled_projection_dim`."""

    transformer: dict[str, Any] = field(default_factory=lambda: preset("tiny"))
    clip_l: tuple[int, int] = (8, 8)
    clip_g: tuple[int, int] = (12, 12)
    clip_layers: int = 2
    t5_layers: int = 2
    t5_heads: int = 2
    t5_ff: int = 32
    vae_block_channels: tuple[int, ...] = (8, 8, 8, 8)  # four blocks: SD3's 8x spatial compression
    shift: float = 3.0  # SD3.5's scheduler shift

    def transformer_config(self) -> dict[str, Any]:
        """The transformer's diffusers config."""
        return dict(self.transformer)


def build_clip_tokenizer():
    """A byte-level `CLIPTokenizer`: every byte symbol and its `</w>` (end-of-word) form, no merges, so a word is
    its bytes; CLIP's `<|startoftext|>` / `<|endoftext|>` (the pad token too, as CLIP's) and a 77-token context."""
    from transformers import CLIPTokenizer

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": len(symbols) + i for i, s in enumerate(symbols)})
    for tok in ("<|startoftext|>", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_CONTEXT)


def build_t5_tokenizer():
    """A `T5Tokenizer` (unigram) over printable ASCII: T5's `<pad>` 0, `</s>` 1, `<unk>` 2, the word-start
    marker and one piece per character; no sentinel tokens."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _clip(hidden: int, projection: int, layers: int, vocab_size: int, eos: int, bos: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=CLIP_CONTEXT, projection_dim=projection, eos_token_id=eos,
        bos_token_id=bos, pad_token_id=eos,
    )).eval()


def tiny_vae(latent_channels: int, block_channels: tuple[int, ...], scaling_factor: float, shift_factor: float):
    """An `AutoencoderKL` (SD3's and FLUX's VAE class) with one layer per block, `len(block_channels)` blocks (4: the
    8x spatial compression) and the published latent normalisation, drawn from torch's current seed."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * len(block_channels),
        up_block_types=("UpDecoderBlock2D",) * len(block_channels),
        block_out_channels=block_channels, layers_per_block=1, norm_num_groups=4,
        scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def tiny_t5(tokenizer, d_model: int, heads: int, ff: int, layers: int):
    """A gated-GELU `T5EncoderModel` (T5 v1.1's, as SD3 and FLUX use) of width `d_model` over `tokenizer`'s
    vocabulary, drawn from torch's current seed."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // heads, d_ff=ff, num_layers=layers,
        num_heads=heads, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )).eval()


def build_components(cfg: TinySD3PipelineConfig, seed: int) -> dict:
    """Every pipeline component, weights drawn from `seed` (one seeded stream per component)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    t = cfg.transformer_config()
    (l_hidden, l_proj), (g_hidden, g_proj) = cfg.clip_l, cfg.clip_g
    joint, pooled = t["joint_attention_dim"], t["pooled_projection_dim"]
    if l_hidden + g_hidden > joint:
        raise ValueError(f"CLIP hidden sizes {l_hidden} + {g_hidden} exceed joint_attention_dim {joint}")
    if l_proj + g_proj != pooled:
        raise ValueError(f"CLIP projections {l_proj} + {g_proj} != pooled_projection_dim {pooled}")
    if t["in_channels"] != t["out_channels"]:
        raise ValueError("in_channels and out_channels must both be the VAE's latent channels")
    if t["joint_attention_dim"] % cfg.t5_heads:
        raise ValueError(f"joint_attention_dim {t['joint_attention_dim']} is not divisible by {cfg.t5_heads} T5 heads")
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    eos, bos = clip_tok.convert_tokens_to_ids("<|endoftext|>"), clip_tok.convert_tokens_to_ids("<|startoftext|>")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(**t).eval()
        torch.manual_seed(seed + 1)
        # SD3.5's published latent normalisation (vae/config.json)
        vae = tiny_vae(t["in_channels"], cfg.vae_block_channels, scaling_factor=1.5305, shift_factor=0.0609)
        torch.manual_seed(seed + 2)
        text_encoder = _clip(l_hidden, l_proj, cfg.clip_layers, len(clip_tok), eos, bos)
        torch.manual_seed(seed + 3)
        text_encoder_2 = _clip(g_hidden, g_proj, cfg.clip_layers, len(clip_tok), eos, bos)
        torch.manual_seed(seed + 4)
        text_encoder_3 = tiny_t5(t5_tok, t["joint_attention_dim"], cfg.t5_heads, cfg.t5_ff, cfg.t5_layers)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.shift)
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler,
            "text_encoder": text_encoder, "tokenizer": clip_tok, "text_encoder_2": text_encoder_2,
            "tokenizer_2": build_clip_tokenizer(), "text_encoder_3": text_encoder_3, "tokenizer_3": t5_tok}


def make_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, config: TinySD3PipelineConfig | None = None,
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
    from diffusers import StableDiffusion3Pipeline

    cfg = config or TinySD3PipelineConfig()
    return write_tiny_pipeline(out_dir, lambda: StableDiffusion3Pipeline(**build_components(cfg, seed)), seed,
                               asdict(cfg), overwrite)
