"""Write a complete, tiny Qwen-Image pipeline folder offline, deterministically from a seed.

The folder is what `QwenImagePipeline.from_pretrained(folder, local_files_only=True)` loads: a tiny
`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`, a tiny `Qwen2_5_VLForConditionalGeneration` text
encoder, a byte-level `Qwen2Tokenizer` built by hand (the 256 byte symbols, no merges, plus the Qwen chat
special tokens) and a `FlowMatchEulerDiscreteScheduler` with Qwen-Image's dynamic shift. Nothing is
downloaded. The transformer's heads divide by 2 and 4 (tensor/context-parallel tests) and its head
dimension equals the sum of the RoPE axes, as diffusers requires.

CLI: python tools/make_tiny_pipeline.py --out /tmp/tiny-qwen-image --seed 0
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Qwen2.5-VL's special tokens that its config refers to by id, plus the chat markers the prompt template uses.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


@dataclass(frozen=True)
class TinyTransformerConfig:
    """QwenImageTransformer2DModel settings (diffusers names). in_channels = 4 * vae z_dim."""

    num_layers: int = 2
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16


# The `small` preset of the rollout benchmark: a few million parameters.
SMALL_TRANSFORMER = TinyTransformerConfig(
    num_layers=4, num_attention_heads=8, attention_head_dim=32, axes_dims_rope=(8, 12, 12)
)


@dataclass(frozen=True)
class TinyPipelineConfig:
    """Sizes of every component; the defaults make a folder of about 2 MB."""

    transformer: TinyTransformerConfig = field(default_factory=TinyTransformerConfig)
    text_hidden_size: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_intermediate_size: int = 64
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2, 2, 2)
    vae_num_res_blocks: int = 1
    # Whole words the byte-level tokenizer merges into one token each (BPE merges), e.g. the prompt
    # template's words so that the template's dropped prefix is exactly QwenImagePipeline's 34 tokens.
    merged_words: tuple[str, ...] = ()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map that byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_tokenizer(merged_words: tuple[str, ...] = ()):
    """A byte-level Qwen2Tokenizer: ids 0..255 are the bytes, then the special tokens, then one token per
    merged word (a chain of BPE merges that grows the word one byte at a time; a leading space is part of
    the word, as the Qwen pre-tokenizer splits words)."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    byte_map = bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    merges: list[tuple[str, str]] = []
    for word in merged_words:
        symbols = [byte_map[b] for b in word.encode("utf-8")]
        prefix = symbols[0]
        for sym in symbols[1:]:
            merged = prefix + sym
            if merged not in vocab:
                merges.append((prefix, sym))
                vocab[merged] = len(vocab)
            prefix = merged
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048)
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS[1:]]}
    )
    for t in SPECIAL_TOKENS:
        if tok.convert_tokens_to_ids(t) != vocab[t]:
            raise RuntimeError(f"special token {t} did not keep id {vocab[t]}")
    return tok


def _text_encoder(cfg: TinyPipelineConfig, vocab_size: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = cfg.text_hidden_size // cfg.text_heads
    if head_dim % 2:
        raise ValueError("text head dim must be even (rotary)")
    quarter = head_dim // 2
    # Qwen2.5-VL's multimodal RoPE splits each head's rotary half into (t, h, w) sections.
    mrope = [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3]
    ids = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": cfg.text_hidden_size,
            "intermediate_size": cfg.text_intermediate_size,
            "num_hidden_layers": cfg.text_layers,
            "num_attention_heads": cfg.text_heads,
            "num_key_value_heads": cfg.text_heads,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": cfg.text_hidden_size,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_components(cfg: TinyPipelineConfig, seed: int) -> dict:
    """All five pipeline components, weights drawn from `seed` (one seeded stream per component)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    t = cfg.transformer
    if t.attention_head_dim != sum(t.axes_dims_rope):
        raise ValueError(f"attention_head_dim {t.attention_head_dim} must equal sum(axes_dims_rope)")
    if t.in_channels % 4 or t.in_channels // 4 != t.out_channels:
        raise ValueError("in_channels must be 4 * out_channels (2x2 packing of the VAE latents)")
    z_dim = t.out_channels
    tokenizer = build_tokenizer(cfg.merged_words)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=t.patch_size,
            in_channels=t.in_channels,
            out_channels=t.out_channels,
            num_layers=t.num_layers,
            attention_head_dim=t.attention_head_dim,
            num_attention_heads=t.num_attention_heads,
            joint_attention_dim=cfg.text_hidden_size,
            axes_dims_rope=tuple(t.axes_dims_rope),
        ).eval()
        torch.manual_seed(seed + 1)
        g = torch.Generator().manual_seed(seed + 2)
        vae = AutoencoderKLQwenImage(
            base_dim=cfg.vae_base_dim,
            z_dim=z_dim,
            dim_mult=list(cfg.vae_dim_mult),
            num_res_blocks=cfg.vae_num_res_blocks,
            # one entry per downsampling stage (len(dim_mult) - 1): the VAE's scale is 2 ** len(...)
            temperal_downsample=[False] + [True] * (len(cfg.vae_dim_mult) - 2),
            latents_mean=[round(float(x), 4) for x in 0.1 * torch.randn(z_dim, generator=g)],
            latents_std=[round(float(x), 4) for x in 1.0 + 0.5 * torch.rand(z_dim, generator=g)],
        ).eval()
        torch.manual_seed(seed + 3)
        text_encoder = _text_encoder(cfg, vocab_size=len(tokenizer))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def make_tiny_pipeline(
    out_dir: str | os.PathLike, seed: int = 0, config: TinyPipelineConfig | None = None, overwrite: bool = False
) -> Path:
    """Write the pipeline folder to `out_dir` (built in a temp folder beside it, then renamed).

    Args:
        out_dir: destination; must not exist unless overwrite.
        seed: weights are a function of the seed only.
        config: component sizes (default: the tiny preset).
        overwrite: replace an existing folder.

    Returns:
        The folder's path.
    """
    from diffusers import QwenImagePipeline

    cfg = config or TinyPipelineConfig()
    return write_tiny_pipeline(out_dir, lambda: QwenImagePipeline(**build_components(cfg, seed)), seed, asdict(cfg),
                               overwrite)


def write_tiny_pipeline(out_dir: str | os.PathLike, build, seed: int, config: dict, overwrite: bool = False) -> Path:
    """Build a tiny pipeline (`build()`, seeded by the caller) and save it to `out_dir` atomically, with a
    `tiny_pipeline.txt` recording the seed and `config`; FileExistsError when `out_dir` exists and not
    `overwrite`. Returns the folder."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    save_pipeline_atomically(build(), out, {"tiny_pipeline.txt": f"seed={seed}\nconfig={config}\n"})
    return out


def save_pipeline_atomically(pipe, out: Path, extra_files: dict[str, str | Path] | None = None) -> None:
    """Save `pipe` (diffusers layout, safetensors) and `extra_files` (name -> text, or a file to copy) into
    `out`: built in a temp folder beside it, then renamed over it, so `out` is never half-written. The
    components' `_name_or_path` (where they were loaded from, meaningless once shipped) is dropped."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)
        pipe.save_pretrained(tmp, safe_serialization=True)
        for config in [tmp / "model_index.json", *tmp.glob("*/config.json")]:
            data = json.loads(config.read_text())
            if data.pop("_name_or_path", None) is not None:
                config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        for name, content in (extra_files or {}).items():
            if isinstance(content, Path):
                shutil.copy(content, tmp / name)
            else:
                (tmp / name).write_text(content)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
