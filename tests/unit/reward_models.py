"""Tiny random-weight reward models saved in their published layouts (test fixtures; nothing downloaded).

- `save_clip_folder`: a transformers CLIPModel folder with a CLIP processor (preprocessor_config.json and a
  byte-level CLIP BPE tokenizer: the 256 byte symbols, their end-of-word forms and the two specials, no merges),
  the layout of PickScore_v1 / openai/clip-vit-large-patch14;
- `save_aesthetic_mlp`: the LAION aesthetic MLP's `.pth` state dict (`layers.{0,2,4,6,7}`);
- `open_clip_state_dict`: a tiny CLIP in open_clip's (OpenAI's) state-dict layout, saved as HPSv2's checkpoint
  is ({"state_dict": ...}).
"""

from __future__ import annotations

import json
import os

import torch

TINY_ARCH = {"vision_width": 32, "vision_layers": 2, "vision_head_width": 16, "patch": 8, "image_size": 32,
             "text_width": 32, "text_layers": 2, "text_heads": 2, "context": 16, "vocab": 514,
             "embed_dim": 24, "act": "gelu"}


def _bytes_to_unicode() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def save_clip_tokenizer(folder: str, context: int = 16) -> None:
    """A CLIP BPE tokenizer without merges (every byte a token): vocab.json, merges.txt, tokenizer files."""
    from transformers import CLIPTokenizer, CLIPTokenizerFast

    os.makedirs(folder, exist_ok=True)
    syms = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(syms + [s + "</w>" for s in syms])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    slow = CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                         model_max_length=context, pad_token="<|endoftext|>")
    CLIPTokenizerFast.from_pretrained(folder, model_max_length=context, pad_token="<|endoftext|>",
                                      local_files_only=True).save_pretrained(folder)
    del slow


def save_clip_folder(folder: str, seed: int = 0, projection_dim: int = 24) -> None:
    """A tiny transformers CLIPModel (random weights, `seed`) with its processor in `folder`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config={"vocab_size": 514, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 16, "eos_token_id": 513,
                     "bos_token_id": 512, "pad_token_id": 513, "hidden_act": "gelu"},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8, "hidden_act": "gelu"},
        projection_dim=projection_dim, logit_scale_init_value=2.6592)
    CLIPModel(cfg).eval().save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    save_clip_tokenizer(folder)


def save_aesthetic_mlp(path: str, d_in: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """The aesthetic MLP's state dict (random, `seed`) saved to `path`; returns it."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, d_in), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd[f"layers.{i}.weight"] = torch.randn(o, n, generator=g) / n ** 0.5
        sd[f"layers.{i}.bias"] = torch.randn(o, generator=g) * 0.1
    torch.save(sd, path)
    return sd


def open_clip_state_dict(arch: dict = TINY_ARCH, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as open_clip's CLIP (`visual.*`, text tower at top level)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, s: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    vw, tw, p, d = arch["vision_width"], arch["text_width"], arch["patch"], arch["embed_dim"]
    grid = arch["image_size"] // p
    sd = {"visual.conv1.weight": r(vw, 3, p, p), "visual.class_embedding": r(vw), "visual.positional_embedding":
          r(grid * grid + 1, vw), "visual.proj": r(vw, d, s=0.2), "token_embedding.weight": r(arch["vocab"], tw),
          "positional_embedding": r(arch["context"], tw), "text_projection": r(tw, d, s=0.2),
          "logit_scale": torch.tensor(4.6052)}
    for ln in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        w = tw if ln == "ln_final" else vw
        sd[f"{ln}.weight"], sd[f"{ln}.bias"] = 1 + r(w), r(w)
    for prefix, w, n in (("visual.transformer", vw, arch["vision_layers"]), ("transformer", tw, arch["text_layers"])):
        for i in range(n):
            b = f"{prefix}.resblocks.{i}."
            sd.update({b + "ln_1.weight": 1 + r(w), b + "ln_1.bias": r(w), b + "ln_2.weight": 1 + r(w),
                       b + "ln_2.bias": r(w), b + "attn.in_proj_weight": r(3 * w, w, s=0.2),
                       b + "attn.in_proj_bias": r(3 * w), b + "attn.out_proj.weight": r(w, w, s=0.2),
                       b + "attn.out_proj.bias": r(w), b + "mlp.c_fc.weight": r(4 * w, w, s=0.2),
                       b + "mlp.c_fc.bias": r(4 * w), b + "mlp.c_proj.weight": r(w, 4 * w, s=0.1),
                       b + "mlp.c_proj.bias": r(w)})
    return sd


def save_bert_tokenizer(folder: str) -> int:
    """A lowercasing WordPiece tokenizer (bert-base-uncased's layout: vocab.txt) of the specials, a-z and 0-9;
    returns its size."""
    from transformers import BertTokenizerFast

    os.makedirs(folder, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789",
             *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]]
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(words) + "\n")
    BertTokenizerFast(os.path.join(folder, "vocab.txt"), do_lower_case=True).save_pretrained(folder)
    return len(words)


def imagereward_state_dict(vocab: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict, object, object]:
    """A tiny ImageReward.pt state dict (BLIP timm-style ViT names, BLIP BERT names, mlp.layers.*) made from random
    transformers BlipVisionModel / BlipTextModel (returned too, with the arch, for reference computations)."""
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    torch.manual_seed(seed)
    arch = {"vision_heads": 2, "text_heads": 2, "vision_eps": 1e-6, "text_eps": 1e-12, "vision_width": 32,
            "vision_layers": 2, "text_width": 24, "text_layers": 2}
    vision = BlipVisionModel(BlipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=32, patch_size=8,
                                              layer_norm_eps=1e-6)).eval()
    text = BlipTextModel(BlipTextConfig(vocab_size=vocab, hidden_size=24, encoder_hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                                        is_decoder=True, bos_token_id=None, sep_token_id=None, pad_token_id=0),
                         add_pooling_layer=False).eval()
    v = vision.state_dict()
    sd = {"blip.visual_encoder.cls_token": v["embeddings.class_embedding"],
          "blip.visual_encoder.pos_embed": v["embeddings.position_embedding"],
          "blip.visual_encoder.patch_embed.proj.weight": v["embeddings.patch_embedding.weight"],
          "blip.visual_encoder.patch_embed.proj.bias": v["embeddings.patch_embedding.bias"],
          "blip.visual_encoder.norm.weight": v["post_layernorm.weight"],
          "blip.visual_encoder.norm.bias": v["post_layernorm.bias"]}
    names = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
             "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for i in range(2):
        for a, b in names.items():
            for t in ("weight", "bias"):
                sd[f"blip.visual_encoder.blocks.{i}.{a}.{t}"] = v[f"encoder.layers.{i}.{b}.{t}"]
    sd.update({f"blip.text_encoder.{k}": t for k, t in text.state_dict().items()})
    sd["blip.text_proj.weight"] = torch.zeros(4, 24)  # a BLIP_Pretrain tensor the scorer does not use
    g = torch.Generator().manual_seed(seed + 1)
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, 24), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd[f"mlp.layers.{i}.weight"] = torch.randn(o, n, generator=g) / n ** 0.5
        sd[f"mlp.layers.{i}.bias"] = torch.randn(o, generator=g) * 0.1
    return sd, arch, vision, text
