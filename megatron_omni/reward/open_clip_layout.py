"""open_clip's CLIP state-dict layout -> transformers' CLIPModel (so HPSv2.1 runs without open_clip/torchvision).

open-clip-torch imports torchvision, and the only torchvision wheel for torch 2.13 here is CUDA-linked and
cannot import beside the CPU torch; so an open_clip checkpoint (HPSv2.1's `HPS_v2.1_compressed.pt`, a
ViT-H-14) is converted to transformers' `CLIPModel`, which computes the same function.

Layout facts (open_clip `model.py`, `transformer.py`; the OpenAI CLIP layout with the same names):
- image tower `visual.*`: `conv1.weight` [W, 3, p, p] (no bias), `class_embedding` [W], `positional_embedding`
  [(S/p)^2 + 1, W], `ln_pre`, `transformer.resblocks.{i}.{ln_1, attn.in_proj_weight [3W, W], attn.in_proj_bias
  [3W], attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}`, `ln_post`, `proj` [W, D] (x @ proj, so the transposed
  Linear weight);
- text tower at the top level: `token_embedding.weight` [V, Wt], `positional_embedding` [77, Wt],
  `transformer.resblocks.{i}.*` as above, `ln_final`, `text_projection` [Wt, D]; `logit_scale` (a log);
- the attention's fused `in_proj` is [q; k; v] stacked along rows; heads are not in the shapes: open_clip
  names them per architecture (ViT-H-14: image width 1280 with 80-wide heads = 16 heads, 32 layers, patch 14,
  224 px; text width 1024, 16 heads, 24 layers; D = 1024; exact GELU, LayerNorm eps 1e-5);
- the text feature is read at the end-of-text token (the largest id, 49407, `argmax` of the ids in open_clip),
  which is where transformers' CLIP pools when its eos_token_id is 49407; padding sits after it and the causal
  mask keeps it out.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_omni.reward.errors import RewardWeightsError

# open_clip model configs (open_clip/model_configs/*.json), the fields the layout does not carry.
ARCHS: dict[str, dict[str, Any]] = {
    "ViT-H-14": {"vision_width": 1280, "vision_layers": 32, "vision_head_width": 80, "patch": 14, "image_size": 224,
                 "text_width": 1024, "text_layers": 24, "text_heads": 16, "context": 77, "vocab": 49408,
                 "embed_dim": 1024, "act": "gelu"},
    "ViT-L-14": {"vision_width": 1024, "vision_layers": 24, "vision_head_width": 64, "patch": 14, "image_size": 224,
                 "text_width": 768, "text_layers": 12, "text_heads": 12, "context": 77, "vocab": 49408,
                 "embed_dim": 768, "act": "gelu"},
}
_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.")


def _layers(sd: dict[str, torch.Tensor], visual: bool) -> int:
    found = {int(m.group(2)) for k in sd if (m := _BLOCK.match(k)) and bool(m.group(1)) == visual}
    return max(found) + 1 if found else 0


def layout_of(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The architecture fields an open_clip state dict's shapes carry (widths, layers, patch, image size, ...)."""
    need = ["visual.conv1.weight", "visual.positional_embedding", "visual.proj", "token_embedding.weight",
            "positional_embedding", "text_projection", "logit_scale"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise KeyError(f"not an open_clip CLIP state dict: missing {missing}")
    conv = sd["visual.conv1.weight"]
    grid = int(round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5))
    return {"vision_width": conv.shape[0], "vision_layers": _layers(sd, True), "patch": conv.shape[-1],
            "image_size": grid * conv.shape[-1], "text_width": sd["token_embedding.weight"].shape[1],
            "text_layers": _layers(sd, False), "context": sd["positional_embedding"].shape[0],
            "vocab": sd["token_embedding.weight"].shape[0], "embed_dim": sd["text_projection"].shape[1]}


def check_arch(sd: dict[str, torch.Tensor], arch: dict[str, Any], where: str) -> None:
    """RewardWeightsError naming `where` and every field where the state dict differs from `arch`."""
    try:
        got = layout_of(sd)
    except KeyError as exc:
        raise RewardWeightsError(f"{where}: {exc.args[0]}") from None
    diff = {k: (got[k], arch[k]) for k in got if k in arch and got[k] != arch[k]}
    if diff:
        raise RewardWeightsError(f"{where}: the checkpoint is another architecture than expected: "
                                 + ", ".join(f"{k} {g} (expected {e})" for k, (g, e) in diff.items()))


def clip_config(arch: dict[str, Any], eos_token_id: int, pad_token_id: int) -> Any:
    """transformers CLIPConfig of an open_clip architecture."""
    from transformers import CLIPConfig

    vw, tw = arch["vision_width"], arch["text_width"]
    return CLIPConfig(
        text_config={"vocab_size": arch["vocab"], "hidden_size": tw, "intermediate_size": 4 * tw,
                     "num_hidden_layers": arch["text_layers"], "num_attention_heads": arch["text_heads"],
                     "max_position_embeddings": arch["context"], "hidden_act": arch["act"],
                     "projection_dim": arch["embed_dim"], "eos_token_id": eos_token_id,
                     "pad_token_id": pad_token_id, "bos_token_id": eos_token_id - 1, "layer_norm_eps": 1e-5},
        vision_config={"hidden_size": vw, "intermediate_size": 4 * vw, "num_hidden_layers": arch["vision_layers"],
                       "num_attention_heads": vw // arch["vision_head_width"], "image_size": arch["image_size"],
                       "patch_size": arch["patch"], "hidden_act": arch["act"], "projection_dim": arch["embed_dim"],
                       "layer_norm_eps": 1e-5},
        projection_dim=arch["embed_dim"],
    )


def _block(sd: dict[str, torch.Tensor], src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    q, k, v = sd[f"{src}attn.in_proj_weight"].chunk(3, dim=0)
    qb, kb, vb = sd[f"{src}attn.in_proj_bias"].chunk(3, dim=0)
    for name, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
        out[f"{dst}self_attn.{name}_proj.weight"], out[f"{dst}self_attn.{name}_proj.bias"] = w, b
    pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
             "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for a, b_ in pairs.items():
        for p in ("weight", "bias"):
            out[f"{dst}{b_}.{p}"] = sd[f"{src}{a}.{p}"]


def to_transformers(sd: dict[str, torch.Tensor], arch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict renamed and reshaped into transformers' CLIPModel names."""
    out = {
        "vision_model.embeddings.class_embedding": sd["visual.class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": sd["visual.conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": sd["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": sd["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": sd["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": sd["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": sd["visual.ln_post.bias"],
        "visual_projection.weight": sd["visual.proj"].t().contiguous(),
        "text_model.embeddings.token_embedding.weight": sd["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": sd["positional_embedding"],
        "text_model.final_layer_norm.weight": sd["ln_final.weight"],
        "text_model.final_layer_norm.bias": sd["ln_final.bias"],
        "text_projection.weight": sd["text_projection"].t().contiguous(),
        "logit_scale": sd["logit_scale"].reshape(()),
    }
    for i in range(arch["vision_layers"]):
        _block(sd, f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}.", out)
    for i in range(arch["text_layers"]):
        _block(sd, f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}.", out)
    return out


def build_clip(sd: dict[str, torch.Tensor], arch: dict[str, Any], eos_token_id: int, pad_token_id: int,
               where: str) -> Any:
    """A transformers CLIPModel holding an open_clip checkpoint; every tensor of the model must be filled
    (RewardWeightsError naming `where` and the first missing ones otherwise)."""
    from transformers import CLIPModel

    check_arch(sd, arch, where)
    model = CLIPModel(clip_config(arch, eos_token_id, pad_token_id)).eval()
    try:
        converted = to_transformers(sd, arch)
    except KeyError as exc:
        raise RewardWeightsError(f"{where}: open_clip tensor {exc.args[0]!r} is missing") from None
    result = model.load_state_dict(converted, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise RewardWeightsError(f"{where}: converted checkpoint does not fill CLIPModel: missing {missing[:5]}, "
                                 f"unexpected {result.unexpected_keys[:5]}")
    return model
