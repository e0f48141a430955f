"""CPU cost per image of each model scorer at its PUBLISHED size (random weights: the cost depends on the
architecture, not the values), through our scorer code: preprocessing, image and text towers, head.

    PYTHONPATH=. python tools/reward_scorer_cost.py [--threads 1] [--batch 4] [--size 512] [--reps 3]

Each scorer scores `batch` images of size x size with prompts; the median of `reps` timed calls (after one
warm-up call) divided by `batch` is printed per scorer. What a user would run instead (open_clip for HPSv2,
the image-reward package) does not install beside the pinned CPU torch (docs/rewards.md), so there is no side to
compare against: the figures are absolute, on this machine's cores, and move with other load on them. That is
why this is a tool and not a benchmark (benchmarks/ holds side-by-side comparisons, ratio last).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image


def clip_config(vw: int, vl: int, vh: int, patch: int, tw: int, tl: int, th: int, proj: int, act: str):  # noqa: ANN201
    from transformers import CLIPConfig

    return CLIPConfig(text_config={"vocab_size": 49408, "hidden_size": tw, "intermediate_size": 4 * tw,
                                   "num_hidden_layers": tl, "num_attention_heads": th, "max_position_embeddings": 77,
                                   "hidden_act": act, "eos_token_id": 513, "bos_token_id": 512, "pad_token_id": 513},
                      vision_config={"hidden_size": vw, "intermediate_size": 4 * vw, "num_hidden_layers": vl,
                                     "num_attention_heads": vh, "image_size": 224, "patch_size": patch,
                                     "hidden_act": act}, projection_dim=proj)


def word_tokenizer(max_length: int):  # noqa: ANN201
    """A word-level tokenizer: prompts are padded to the model's context either way, so the towers' cost is that
    of the published tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a photograph of red bicycle leaning against brick wall golden hour".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[PAD]", "[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   model_max_length=max_length)


def random_mlp(d_in: int) -> dict[str, torch.Tensor]:
    """The aesthetic / ImageReward head's state dict (layers.{0,2,4,6,7}) with random values."""
    dims = [d_in, 1024, 128, 64, 16, 1]
    return {f"layers.{i}.{t}": v for i, (a, b) in zip((0, 2, 4, 6, 7), zip(dims, dims[1:]))
            for t, v in torch.nn.Linear(a, b).state_dict().items()}


def embedder(cfg):  # noqa: ANN001, ANN201
    from transformers import CLIPImageProcessor, CLIPModel

    from megatron_omni.reward.clip_scorers import CLIP_MEAN, CLIP_STD, ClipEmbedder

    proc = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                              image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD), resample=3)
    return ClipEmbedder(CLIPModel(cfg).eval(), proc, word_tokenizer(77), torch.device("cpu"), torch.float32, 16)


def build(name: str):  # noqa: ANN201
    from megatron_omni.reward import clip_scorers, imagereward

    vit_h = clip_config(1280, 32, 16, 14, 1024, 24, 16, 1024, "gelu")  # PickScore_v1 / HPSv2.1 (ViT-H-14)
    vit_l = clip_config(1024, 24, 16, 14, 768, 12, 12, 768, "quick_gelu")  # openai/clip-vit-large-patch14
    classes = {"pickscore": clip_scorers.PickScore, "hpsv2": clip_scorers.HPSv2, "clipscore": clip_scorers.ClipScore,
               "aesthetic": clip_scorers.Aesthetic}
    if name in classes:  # the scorer object around a model built here (no weights folder to load)
        s = classes[name].__new__(classes[name])
        s.w = 2.5
        s.clip = embedder(vit_h if name in ("pickscore", "hpsv2") else vit_l)
        if name == "aesthetic":
            s.mlp = clip_scorers.aesthetic_mlp(random_mlp(768), "bench")
        return s
    if name == "imagereward":  # the checkpoint's layout through our loader (ImageRewardModel), from memory
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel, CLIPImageProcessor

        vision = BlipVisionModel(BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                  num_attention_heads=16, image_size=224, patch_size=16))
        text = BlipTextModel(BlipTextConfig(vocab_size=30524, hidden_size=768, encoder_hidden_size=1024,
                                            intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                            is_decoder=True), add_pooling_layer=False)
        sd = {f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()}
        v = vision.state_dict()
        sd.update({"blip.visual_encoder.cls_token": v["embeddings.class_embedding"],
                   "blip.visual_encoder.pos_embed": v["embeddings.position_embedding"],
                   "blip.visual_encoder.patch_embed.proj.weight": v["embeddings.patch_embedding.weight"],
                   "blip.visual_encoder.patch_embed.proj.bias": v["embeddings.patch_embedding.bias"],
                   "blip.visual_encoder.norm.weight": v["post_layernorm.weight"],
                   "blip.visual_encoder.norm.bias": v["post_layernorm.bias"]})
        for i in range(24):
            for a, b in imagereward._VISION.items():
                for t in ("weight", "bias"):
                    sd[f"blip.visual_encoder.blocks.{i}.{a}.{t}"] = v[f"encoder.layers.{i}.{b}.{t}"]
        sd.update({f"mlp.{k}": t for k, t in random_mlp(768).items()})
        del vision, text, v
        scorer = imagereward.ImageReward.__new__(imagereward.ImageReward)
        scorer.model = imagereward.ImageRewardModel(sd, imagereward.ARCHS["ImageReward-v1.0"], "bench")
        scorer.tokenizer, scorer.device, scorer.dtype, scorer.batch_size = word_tokenizer(35), torch.device("cpu"), \
            torch.float32, 16
        scorer.processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                              image_mean=list(clip_scorers.CLIP_MEAN),
                                              image_std=list(clip_scorers.CLIP_STD), resample=3)
        return scorer
    raise ValueError(name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scorers", default="clipscore,aesthetic,imagereward,pickscore,hpsv2")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (a.size, a.size, 3), dtype=np.uint8)) for _ in range(a.batch)]
    prompts = ["a photograph of a red bicycle leaning against a brick wall, golden hour"] * a.batch
    rows = []
    for name in a.scorers.split(","):
        scorer = build(name)
        scorer(images, prompts)  # warm-up
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            scorer(images, prompts)
            times.append(time.perf_counter() - t0)
        per = statistics.median(times) / a.batch
        rows.append((name, per))
        print(f"{name:12s} {per * 1000:8.0f} ms/image (median of {a.reps} x {a.batch} images {a.size}px, "
              f"{a.threads} thread(s))", flush=True)
        del scorer
    print("scorer costs (s/image): " + ", ".join(f"{n} {t:.2f}" for n, t in rows))


if __name__ == "__main__":
    main()
