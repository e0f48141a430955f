"""CLIP-family scorers: PickScore, CLIP score, the LAION aesthetic predictor and HPSv2.1 (docs/rewards.md).

Each loads its published weights from local paths given as options (nothing is downloaded, there is no default
model), checks them (RewardWeightsError naming the path and what was expected), runs on the device the server
gives it, and scores in batches of `batch_size` images:

- `pickscore`: PickScore_v1 (a CLIP ViT-H/14 `CLIPModel` folder) with the CLIP-ViT-H-14 processor;
  reward = logit_scale.exp() * cos(image embedding, prompt embedding), as PickScore's model card computes it;
- `clipscore`: CLIP-S (Hessel et al. 2021) on a `CLIPModel` folder (CLIP ViT-L/14): 2.5 * max(cos, 0);
- `aesthetic`: the LAION improved aesthetic predictor, an MLP (768 -> 1024 -> 128 -> 64 -> 16 -> 1) on the
  L2-normalised CLIP ViT-L/14 image embedding (`sac+logos+ava1-l14-linearMSE.pth`); the prompt is not used;
- `hpsv2`: HPSv2.1 (`HPS_v2.1_compressed.pt`, an open_clip ViT-H-14) converted to transformers' CLIPModel
  (open_clip_layout.py); reward = cos(image, prompt), as HPSv2's `score` returns it.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from megatron_omni.reward.errors import RewardWeightsError
from megatron_omni.reward.scorers import Scorer
from megatron_omni.reward.weights import (
    hf_config,
    load_state_dict,
    need_processor_files,
    need_tokenizer_files,
    scorer_device,
    scorer_dtype,
)

# OpenAI CLIP's pixel normalisation, which open_clip's ViT-H-14 (and so HPSv2) uses too.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _features(out: Any) -> torch.Tensor:
    """get_*_features returns a tensor in older transformers and an output with the projection in pooler_output
    in 5.x."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class ClipEmbedder:
    """A transformers CLIPModel with its image processor and tokenizer: L2-normalised embeddings in batches."""

    def __init__(self, model: Any, image_processor: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype,
                 batch_size: int):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.model = model.to(device=device, dtype=dtype).eval()
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.device, self.dtype, self.batch_size = device, dtype, int(batch_size)
        self.max_length = int(model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def images(self, images: list[Image.Image]) -> torch.Tensor:
        """[N, D] fp32 unit vectors of N images."""
        out = []
        for i in range(0, len(images), self.batch_size):
            px = self.image_processor(images=images[i:i + self.batch_size], return_tensors="pt")["pixel_values"]
            f = _features(self.model.get_image_features(pixel_values=px.to(self.device, self.dtype))).float()
            out.append(f / f.norm(dim=-1, keepdim=True))
        return torch.cat(out).cpu()

    @torch.no_grad()
    def texts(self, prompts: list[str]) -> torch.Tensor:
        """[N, D] fp32 unit vectors of N prompts (truncated to the model's context, 77 tokens for CLIP)."""
        out = []
        for i in range(0, len(prompts), self.batch_size):
            tok = self.tokenizer(prompts[i:i + self.batch_size], padding="max_length", truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
            f = _features(self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                                       attention_mask=tok["attention_mask"].to(self.device))).float()
            out.append(f / f.norm(dim=-1, keepdim=True))
        return torch.cat(out).cpu()

    def logit_scale(self) -> float:
        """exp(logit_scale), the model's learned temperature."""
        return float(self.model.logit_scale.detach().float().exp())


def load_clip_folder(scorer: str, option: str, folder: str | None, processor: str | None, device: str | None,
                     dtype: str, batch_size: int, what: str) -> ClipEmbedder:
    """A CLIPModel folder (config.json of model_type 'clip' + weights) and its processor folder (default: the
    same folder) -> ClipEmbedder on `device`."""
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizerFast

    hf_config(scorer, option, folder or "", "clip", what)
    proc = processor or folder
    need_processor_files(scorer, "processor" if processor else option, proc,
                         "a CLIP processor folder: preprocessor_config.json with the tokenizer files; give "
                         "processor=<folder> when the model folder has none")
    dev, dt = scorer_device(scorer, device), scorer_dtype(scorer, dtype)
    try:
        model = CLIPModel.from_pretrained(folder, local_files_only=True)
        image_processor = CLIPImageProcessor.from_pretrained(proc, local_files_only=True)
        tokenizer = CLIPTokenizerFast.from_pretrained(proc, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise RewardWeightsError(f"{scorer}: cannot load {option}={folder!r} as {what}: {exc}") from None
    return ClipEmbedder(model, image_processor, tokenizer, dev, dt, batch_size)


class PickScore(Scorer):
    """PickScore_v1: logit_scale.exp() * cos(image, prompt) of a CLIP ViT-H/14 preference model (about 18-23
    on real images)."""

    name = "pickscore"

    def __init__(self, model: str | None = None, processor: str | None = None, device: str | None = None,
                 dtype: str = "float32", batch_size: int = 16):
        self.clip = load_clip_folder(self.name, "model", model, processor, device, dtype, batch_size,
                                     "the PickScore_v1 folder (a transformers CLIPModel, CLIP ViT-H/14)")

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """logit_scale.exp() * cos per (image, prompt) pair."""
        cos = (self.clip.images(images) * self.clip.texts(prompts)).sum(-1)
        return (self.clip.logit_scale() * cos).tolist()


class ClipScore(Scorer):
    """CLIP-S: w * max(cos(image, prompt), 0) with w = 2.5 (Hessel et al. 2021), on CLIP ViT-L/14."""

    name = "clipscore"

    def __init__(self, model: str | None = None, processor: str | None = None, device: str | None = None,
                 dtype: str = "float32", batch_size: int = 16, w: float = 2.5):
        self.w = float(w)
        self.clip = load_clip_folder(self.name, "model", model, processor, device, dtype, batch_size,
                                     "a CLIP folder such as openai/clip-vit-large-patch14 (a transformers CLIPModel)")

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """w * max(cos, 0) per pair."""
        cos = (self.clip.images(images) * self.clip.texts(prompts)).sum(-1)
        return (self.w * cos.clamp(min=0)).tolist()


def aesthetic_mlp(state: dict[str, torch.Tensor], where: str) -> torch.nn.Sequential:
    """The improved-aesthetic-predictor MLP (its `layers` Sequential: Linear, Dropout, Linear, Dropout, Linear,
    Dropout, Linear, Linear) with `state` loaded strictly."""
    try:
        dims = [state[f"layers.{i}.weight"].shape for i in (0, 2, 4, 6, 7)]
    except KeyError as exc:
        raise RewardWeightsError(f"{where}: not the LAION aesthetic MLP (no tensor {exc.args[0]!r}; expected "
                                 "layers.{0,2,4,6,7}.weight/bias)") from None
    expected = [(1024, None), (128, 1024), (64, 128), (16, 64), (1, 16)]
    if any(len(d) != 2 or d[0] != e0 or (e1 is not None and d[1] != e1) for d, (e0, e1) in zip(dims, expected)):
        raise RewardWeightsError(f"{where}: MLP shapes {[tuple(d) for d in dims]} are not the aesthetic predictor's "
                                 "(D->1024->128->64->16->1)")
    d_in = dims[0][1]
    mlp = torch.nn.Sequential(torch.nn.Linear(d_in, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                              torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                              torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()}, strict=True)
    return mlp.eval()


class Aesthetic(Scorer):
    """LAION aesthetic score (about 1-10): MLP(L2-normalised CLIP ViT-L/14 image embedding); prompts unused."""

    name = "aesthetic"

    def __init__(self, model: str | None = None, clip: str | None = None, processor: str | None = None,
                 device: str | None = None, dtype: str = "float32", batch_size: int = 16):
        where = f"{self.name}: model={model!r}"
        state = load_state_dict(self.name, "model", model or "",
                                "the aesthetic MLP file sac+logos+ava1-l14-linearMSE.pth")
        self.mlp = aesthetic_mlp(state, where)
        self.clip = load_clip_folder(self.name, "clip", clip, processor, device, dtype, batch_size,
                                     "the CLIP ViT-L/14 folder (openai/clip-vit-large-patch14)")
        d = self.clip.model.config.projection_dim
        if self.mlp[0].in_features != d:
            raise RewardWeightsError(f"{where} takes {self.mlp[0].in_features}-wide embeddings but clip={clip!r} "
                                     f"gives {d} (expected CLIP ViT-L/14, 768)")
        self.mlp.to(self.clip.device)

    @torch.no_grad()
    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """MLP output per image."""
        emb = self.clip.images(images).to(self.clip.device)
        return self.mlp(emb).squeeze(-1).float().cpu().tolist()


class HPSv2(Scorer):
    """HPSv2.1: cos(image, prompt) of an open_clip ViT-H-14 fine-tuned on human preferences (about 0.2-0.35)."""

    name = "hpsv2"

    def __init__(self, model: str | None = None, tokenizer: str | None = None, arch: str | dict = "ViT-H-14",
                 device: str | None = None, dtype: str = "float32", batch_size: int = 16):
        from transformers import CLIPImageProcessor, CLIPTokenizerFast

        from megatron_omni.reward.open_clip_layout import ARCHS, build_clip

        if isinstance(arch, str):
            if arch not in ARCHS:
                raise RewardWeightsError(f"{self.name}: arch={arch!r} is not one of {sorted(ARCHS)}")
            arch = ARCHS[arch]
        state = load_state_dict(self.name, "model", model or "",
                                "HPS_v2.1_compressed.pt (an open_clip ViT-H-14 state dict)")
        need_tokenizer_files(self.name, "tokenizer", tokenizer or "",
                             "the CLIP BPE tokenizer (e.g. the laion/CLIP-ViT-H-14-laion2B-s32B-b79K folder)")
        tok = CLIPTokenizerFast.from_pretrained(tokenizer, local_files_only=True)
        model_ = build_clip(state, dict(arch), tok.eos_token_id, tok.pad_token_id or 0,
                            f"{self.name}: model={model!r}")
        size = int(arch["image_size"])
        # open_clip's eval transform: resize the short side (bicubic), centre crop, OpenAI mean/std.
        proc = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                  image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD), resample=3)
        self.clip = ClipEmbedder(model_, proc, tok, scorer_device(self.name, device), scorer_dtype(self.name, dtype),
                                 batch_size)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """cos per pair."""
        return (self.clip.images(images) * self.clip.texts(prompts)).sum(-1).tolist()
