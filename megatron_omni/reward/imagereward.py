"""ImageReward (Xu et al. 2023) from its published `ImageReward.pt`, on transformers' BLIP classes.

The `image-reward` package is not used: it pulls a CUDA torch 2.14 and torchvision (checked with pip's dry run),
which cannot live beside the pinned CPU torch 2.13. Its computation (THUDM/ImageReward `ImageReward.score`):
the prompt tokenised by BLIP's BERT tokenizer (bert-base-uncased, padded/truncated to 35 tokens), the image by
resize-short-side 224 (bicubic), centre crop, OpenAI CLIP mean/std; the BLIP ViT-L/16 encodes the image; BLIP's
BERT text encoder reads the prompt with cross-attention to every image token (bidirectional self-attention);
its [CLS] state goes through the MLP 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (no activations: the aesthetic
predictor's shape); reward = (mlp - 0.16717362830052426) / 1.0333394966054072.

Layout facts of ImageReward.pt (a flat state dict; extra BLIP_Pretrain tensors are ignored):
- `blip.visual_encoder.*` (BLIP's timm-style ViT; LayerNorm eps 1e-6): `cls_token` [1, 1, W], `pos_embed`
  [1, (224/16)^2 + 1, W], `patch_embed.proj.{weight, bias}`, `blocks.{i}.{norm1, attn.qkv (fused, rows
  [q; k; v]), attn.proj, norm2, mlp.fc1, mlp.fc2}`, `norm`; ViT-L: W 1024, 24 blocks, 16 heads;
- `blip.text_encoder.*` (BLIP's med BERT, no token-type embeddings, cross-attention in every layer from the
  1024-wide image tokens): `embeddings.{word_embeddings [30524, 768], position_embeddings, LayerNorm}`,
  `encoder.layer.{i}.{attention, crossattention, intermediate, output}.*` -- the names transformers'
  BlipTextModel uses, 12 layers, 12 heads, LayerNorm eps 1e-12;
- `mlp.layers.{0, 2, 4, 6, 7}.{weight, bias}`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from PIL import Image

from megatron_omni.reward.clip_scorers import CLIP_MEAN, CLIP_STD, aesthetic_mlp
from megatron_omni.reward.errors import RewardWeightsError
from megatron_omni.reward.scorers import Scorer
from megatron_omni.reward.weights import load_state_dict, need_path, scorer_device, scorer_dtype

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.score's normalisation
MAX_LENGTH = 35
# The fields the shapes do not carry (BLIP's create_vit('large') and its med_config.json).
ARCHS: dict[str, dict[str, Any]] = {
    "ImageReward-v1.0": {"vision_heads": 16, "text_heads": 12, "vision_eps": 1e-6, "text_eps": 1e-12,
                         "vision_width": 1024, "vision_layers": 24, "text_width": 768, "text_layers": 12},
}
_VISION = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
           "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def _count(sd: dict[str, torch.Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def _vision_state(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    p = "blip.visual_encoder."
    out = {"embeddings.class_embedding": sd[p + "cls_token"], "embeddings.position_embedding": sd[p + "pos_embed"],
           "embeddings.patch_embedding.weight": sd[p + "patch_embed.proj.weight"],
           "embeddings.patch_embedding.bias": sd[p + "patch_embed.proj.bias"],
           "post_layernorm.weight": sd[p + "norm.weight"], "post_layernorm.bias": sd[p + "norm.bias"]}
    for i in range(layers):
        for a, b in _VISION.items():
            for t in ("weight", "bias"):
                out[f"encoder.layers.{i}.{b}.{t}"] = sd[f"{p}blocks.{i}.{a}.{t}"]
    return out


class ImageRewardModel(torch.nn.Module):
    """BLIP ViT + BLIP BERT with cross-attention + the reward MLP, as ImageReward computes it."""

    def __init__(self, sd: dict[str, torch.Tensor], arch: dict[str, Any], where: str):
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        super().__init__()
        try:
            patch = sd["blip.visual_encoder.patch_embed.proj.weight"]
            words = sd["blip.text_encoder.embeddings.word_embeddings.weight"]
            positions = sd["blip.text_encoder.embeddings.position_embeddings.weight"]
            grid = int(round((sd["blip.visual_encoder.pos_embed"].shape[1] - 1) ** 0.5))
            inter_v = sd["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0]
            inter_t = sd["blip.text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[0]
        except KeyError as exc:
            raise RewardWeightsError(f"{where}: not an ImageReward checkpoint (no tensor {exc.args[0]!r}; expected "
                                     "blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*)") from None
        got = {"vision_width": patch.shape[0], "vision_layers": _count(sd, r"blip\.visual_encoder\.blocks\.(\d+)\."),
               "text_width": words.shape[1], "text_layers": _count(sd, r"blip\.text_encoder\.encoder\.layer\.(\d+)\.")}
        diff = {k: (v, arch[k]) for k, v in got.items() if v != arch[k]}
        if diff:
            raise RewardWeightsError(f"{where}: another architecture than expected: "
                                     + ", ".join(f"{k} {g} (expected {e})" for k, (g, e) in diff.items()))
        self.image_size = grid * patch.shape[-1]
        self.vision = BlipVisionModel(BlipVisionConfig(
            hidden_size=got["vision_width"], intermediate_size=inter_v, num_hidden_layers=got["vision_layers"],
            num_attention_heads=arch["vision_heads"], image_size=self.image_size, patch_size=patch.shape[-1],
            layer_norm_eps=arch["vision_eps"], hidden_act="gelu"))
        self.text = BlipTextModel(BlipTextConfig(
            vocab_size=words.shape[0], hidden_size=got["text_width"], encoder_hidden_size=got["vision_width"],
            intermediate_size=inter_t, num_hidden_layers=got["text_layers"], num_attention_heads=arch["text_heads"],
            max_position_embeddings=positions.shape[0], layer_norm_eps=arch["text_eps"], is_decoder=True,
            bos_token_id=None, sep_token_id=None, pad_token_id=0), add_pooling_layer=False)
        self.mlp = aesthetic_mlp({k.removeprefix("mlp."): v for k, v in sd.items() if k.startswith("mlp.")}, where)
        if self.mlp[0].in_features != got["text_width"]:
            raise RewardWeightsError(f"{where}: MLP input {self.mlp[0].in_features} != text width {got['text_width']}")
        text_sd = {k.removeprefix("blip.text_encoder."): v for k, v in sd.items()
                   if k.startswith("blip.text_encoder.") and not k.endswith("position_ids")}
        for module, state in ((self.vision, _vision_state(sd, got["vision_layers"])), (self.text, text_sd)):
            result = module.load_state_dict(state, strict=False)
            missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
            if missing or result.unexpected_keys:
                raise RewardWeightsError(f"{where}: checkpoint does not fill the model: missing {missing[:5]}, "
                                         f"unexpected {result.unexpected_keys[:5]}")
        self.eval()

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, S, S], token ids / mask [B, L] -> normalised rewards [B] fp32."""
        image = self.vision(pixel_values=pixel_values).last_hidden_state
        ones = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                         encoder_attention_mask=ones, is_decoder=False).last_hidden_state[:, 0].float()
        return ((self.mlp.float()(text).squeeze(-1) - MEAN) / STD).float()


class ImageReward(Scorer):
    """ImageReward v1.0 (roughly N(0, 1) over its training images; higher = preferred)."""

    name = "imagereward"

    def __init__(self, model: str | None = None, tokenizer: str | None = None, arch: str | dict = "ImageReward-v1.0",
                 device: str | None = None, dtype: str = "float32", batch_size: int = 16):
        from transformers import BertTokenizerFast, CLIPImageProcessor

        where = f"{self.name}: model={model!r}"
        if isinstance(arch, str):
            if arch not in ARCHS:
                raise RewardWeightsError(f"{self.name}: arch={arch!r} is not one of {sorted(ARCHS)}")
            arch = ARCHS[arch]
        sd = load_state_dict(self.name, "model", model or "", "ImageReward.pt (BLIP ViT-L + BERT + MLP state dict)")
        need_path(self.name, "tokenizer", tokenizer, "the bert-base-uncased tokenizer folder (vocab.txt)")
        try:
            self.tokenizer = BertTokenizerFast.from_pretrained(tokenizer, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RewardWeightsError(f"{self.name}: tokenizer={tokenizer!r} is not a BERT tokenizer: {exc}") from None
        self.device, self.dtype = scorer_device(self.name, device), scorer_dtype(self.name, dtype)
        self.model = ImageRewardModel(sd, dict(arch), where)
        vocab = self.model.text.config.vocab_size
        if len(self.tokenizer) > vocab:
            raise RewardWeightsError(f"{self.name}: tokenizer={tokenizer!r} has {len(self.tokenizer)} tokens, more "
                                     f"than the checkpoint's {vocab}")
        self.model.to(device=self.device, dtype=self.dtype)
        s = self.model.image_size
        self.processor = CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s},
                                            image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD), resample=3)
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.batch_size = int(batch_size)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """The normalised ImageReward of each (image, prompt) pair."""
        out: list[float] = []
        for i in range(0, len(images), self.batch_size):
            px = self.processor(images=images[i:i + self.batch_size], return_tensors="pt")["pixel_values"]
            tok = self.tokenizer(prompts[i:i + self.batch_size], padding="max_length", truncation=True,
                                 max_length=MAX_LENGTH, return_tensors="pt")
            out += self.model(px.to(self.device, self.dtype), tok["input_ids"].to(self.device),
                              tok["attention_mask"].to(self.device)).cpu().tolist()
        return out
