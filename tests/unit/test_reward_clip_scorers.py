"""PickScore, CLIP score, aesthetic and HPSv2 on tiny random-weight models saved in the published layouts, loaded
through the same registry path a real folder takes, checked against a CLIP forward written here from the
published formulas (pixels by PIL + numpy, attention by hand), and refusing missing or foreign weights."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from megatron_omni.reward.errors import RewardWeightsError
from megatron_omni.reward.registry import build_scorer
from tests.unit.reward_models import (
    TINY_ARCH,
    open_clip_state_dict,
    save_aesthetic_mlp,
    save_clip_folder,
    save_clip_tokenizer,
)

MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
STD = np.array([0.26862954, 0.26130258, 0.27577711])
PROMPTS = ["a red cube on a table", "two cats", "a sign that says OPEN"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("reward_models")
    out = {"clip": str(root / "clip"), "mlp": str(root / "aesthetic.pth"), "hps": str(root / "hps.pt"),
           "tok": str(root / "tok")}
    save_clip_folder(out["clip"], seed=1)
    save_aesthetic_mlp(out["mlp"], d_in=24, seed=2)
    torch.save({"state_dict": open_clip_state_dict(TINY_ARCH, seed=3)}, out["hps"])
    save_clip_tokenizer(out["tok"])
    return out


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    # Square images: the short-side resize then needs no crop, so the reference pixels are unambiguous.
    return [Image.fromarray(rng.integers(0, 256, (s, s, 3), dtype=np.uint8)) for s in (32, 40, 64)]


def ref_pixels(im: Image.Image, size: int = 32) -> torch.Tensor:
    """CLIP's eval transform: bicubic resize to size x size (square input), /255, OpenAI mean/std -> [3, S, S]."""
    a = np.asarray(im.resize((size, size), Image.BICUBIC), dtype=np.float64) / 255.0
    return torch.tensor(((a - MEAN) / STD).transpose(2, 0, 1), dtype=torch.float32)


def ref_tower(x: torch.Tensor, blocks: list[dict], heads: int, causal: bool) -> torch.Tensor:
    """Pre-LN transformer [B, L, W] with exact GELU MLPs; each block: ln1, q/k/v/o (weight, bias), ln2, fc1, fc2."""
    B, L, W = x.shape
    hd = W // heads
    mask = torch.full((L, L), float("-inf")).triu(1) if causal else torch.zeros(L, L)
    for b in blocks:
        h = torch.nn.functional.layer_norm(x, (W,), *b["ln1"], eps=1e-5)
        q, k, v = (torch.nn.functional.linear(h, *b[n]).view(B, L, heads, hd).transpose(1, 2) for n in "qkv")
        att = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5 + mask, dim=-1)
        x = x + torch.nn.functional.linear((att @ v).transpose(1, 2).reshape(B, L, W), *b["o"])
        h = torch.nn.functional.layer_norm(x, (W,), *b["ln2"], eps=1e-5)
        x = x + torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(h, *b["fc1"])),
                                           *b["fc2"])
    return x


def hf_blocks(sd: dict, prefix: str, n: int) -> list[dict]:
    p = lambda k: (sd[f"{k}.weight"], sd[f"{k}.bias"])  # noqa: E731
    return [{"ln1": p(f"{prefix}.{i}.layer_norm1"), "ln2": p(f"{prefix}.{i}.layer_norm2"),
             "q": p(f"{prefix}.{i}.self_attn.q_proj"), "k": p(f"{prefix}.{i}.self_attn.k_proj"),
             "v": p(f"{prefix}.{i}.self_attn.v_proj"), "o": p(f"{prefix}.{i}.self_attn.out_proj"),
             "fc1": p(f"{prefix}.{i}.mlp.fc1"), "fc2": p(f"{prefix}.{i}.mlp.fc2")} for i in range(n)]


def oc_blocks(sd: dict, prefix: str, n: int) -> list[dict]:
    """open_clip blocks: the fused in_proj is [q; k; v] along rows."""
    out = []
    for i in range(n):
        b = f"{prefix}.resblocks.{i}."
        w, bias = sd[b + "attn.in_proj_weight"].chunk(3), sd[b + "attn.in_proj_bias"].chunk(3)
        p = lambda k: (sd[b + k + ".weight"], sd[b + k + ".bias"])  # noqa: E731, B023
        out.append({"ln1": p("ln_1"), "ln2": p("ln_2"), "q": (w[0], bias[0]), "k": (w[1], bias[1]),
                    "v": (w[2], bias[2]), "o": p("attn.out_proj"), "fc1": p("mlp.c_fc"), "fc2": p("mlp.c_proj")})
    return out


def ref_embeddings(names: dict, sd: dict, images: list[Image.Image], prompts: list[str], tok_folder: str,
                   vision_blocks: list[dict], text_blocks: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP's image and text features (unit vectors) from a state dict, by the published forward: patches +
    class token + positions, ln_pre, tower, ln_post of the class token, projection; text: tokens + positions,
    causal tower, ln_final at the end-of-text token, projection."""
    from transformers import CLIPTokenizerFast

    g = lambda k: sd[names[k]]  # noqa: E731
    px = torch.stack([ref_pixels(im) for im in images])
    x = torch.nn.functional.conv2d(px, g("conv"), stride=g("conv").shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([g("cls").expand(len(images), 1, -1), x], dim=1) + g("vpos")
    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), g("ln_pre.w"), g("ln_pre.b"), eps=1e-5)
    x = ref_tower(x, vision_blocks, 2, causal=False)[:, 0]
    img = torch.nn.functional.layer_norm(x, (x.shape[-1],), g("ln_post.w"), g("ln_post.b"), eps=1e-5) @ g("vproj")
    tok = CLIPTokenizerFast.from_pretrained(tok_folder, local_files_only=True)
    ids = tok(prompts, padding="max_length", truncation=True, max_length=16, return_tensors="pt")["input_ids"]
    t = g("tok")[ids] + g("tpos")
    t = ref_tower(t, text_blocks, 2, causal=True)
    t = torch.nn.functional.layer_norm(t, (t.shape[-1],), g("ln_final.w"), g("ln_final.b"), eps=1e-5)
    eot = (ids == tok.eos_token_id).int().argmax(dim=1)
    txt = t[torch.arange(len(prompts)), eot] @ g("tproj")
    return img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)


HF_NAMES = {"conv": "vision_model.embeddings.patch_embedding.weight", "cls": "vision_model.embeddings.class_embedding",
            "vpos": "vision_model.embeddings.position_embedding.weight", "ln_pre.w": "vision_model.pre_layrnorm.weight",
            "ln_pre.b": "vision_model.pre_layrnorm.bias", "ln_post.w": "vision_model.post_layernorm.weight",
            "ln_post.b": "vision_model.post_layernorm.bias", "vproj": "visual_projection.weight.T",
            "tok": "text_model.embeddings.token_embedding.weight",
            "tpos": "text_model.embeddings.position_embedding.weight",
            "ln_final.w": "text_model.final_layer_norm.weight", "ln_final.b": "text_model.final_layer_norm.bias",
            "tproj": "text_projection.weight.T"}
OC_NAMES = {"conv": "visual.conv1.weight", "cls": "visual.class_embedding", "vpos": "visual.positional_embedding",
            "ln_pre.w": "visual.ln_pre.weight", "ln_pre.b": "visual.ln_pre.bias", "ln_post.w": "visual.ln_post.weight",
            "ln_post.b": "visual.ln_post.bias", "vproj": "visual.proj", "tok": "token_embedding.weight",
            "tpos": "positional_embedding", "ln_final.w": "ln_final.weight", "ln_final.b": "ln_final.bias",
            "tproj": "text_projection"}


def hf_reference(folder: str, images: list[Image.Image], prompts: list[str]) -> tuple[torch.Tensor, ...]:
    sd = dict(load_file(os.path.join(folder, "model.safetensors")))
    sd["visual_projection.weight.T"] = sd["visual_projection.weight"].t()
    sd["text_projection.weight.T"] = sd["text_projection.weight"].t()
    img, txt = ref_embeddings(HF_NAMES, sd, images, prompts, folder,
                              hf_blocks(sd, "vision_model.encoder.layers", 2),
                              hf_blocks(sd, "text_model.encoder.layers", 2))
    return img, txt, sd["logit_scale"].exp()


def test_pickscore_is_logit_scale_times_cosine(folders: dict, images: list) -> None:
    scorer = build_scorer({"name": "pickscore", "kwargs": {"model": folders["clip"], "batch_size": 2}})
    img, txt, scale = hf_reference(folders["clip"], images, PROMPTS)
    got = torch.tensor(scorer(images, PROMPTS))
    torch.testing.assert_close(got, scale * (img * txt).sum(-1), atol=2e-4, rtol=1e-4)
    # Batching does not change a score: the same pair scored alone and in a batch of 3.
    assert scorer(images[1:2], PROMPTS[1:2])[0] == pytest.approx(got[1].item(), abs=1e-5)


def test_clipscore_is_clipped_scaled_cosine(folders: dict, images: list) -> None:
    scorer = build_scorer({"name": "clipscore", "kwargs": {"model": folders["clip"]}})
    img, txt, _ = hf_reference(folders["clip"], images, PROMPTS)
    want = 2.5 * (img * txt).sum(-1).clamp(min=0)
    torch.testing.assert_close(torch.tensor(scorer(images, PROMPTS)), want, atol=2e-4, rtol=1e-4)


def test_aesthetic_is_mlp_of_normalised_image_embedding(folders: dict, images: list) -> None:
    scorer = build_scorer({"name": "aesthetic", "kwargs": {"model": folders["mlp"], "clip": folders["clip"]}})
    img, _, _ = hf_reference(folders["clip"], images, PROMPTS)
    sd = torch.load(folders["mlp"], weights_only=True)
    h = img
    for i in (0, 2, 4, 6, 7):  # the dropouts between are identity at eval
        h = h @ sd[f"layers.{i}.weight"].t() + sd[f"layers.{i}.bias"]
    got = torch.tensor(scorer(images, ["ignored"] * 3))
    torch.testing.assert_close(got, h.squeeze(-1), atol=2e-4, rtol=1e-4)
    assert scorer(images, ["another prompt"] * 3) == got.tolist()  # the prompt plays no part


def test_hpsv2_open_clip_checkpoint_is_cosine(folders: dict, images: list) -> None:
    scorer = build_scorer({"name": "hpsv2", "kwargs": {"model": folders["hps"], "tokenizer": folders["tok"],
                                                       "arch": TINY_ARCH}})
    sd = open_clip_state_dict(TINY_ARCH, seed=3)
    img, txt = ref_embeddings(OC_NAMES, sd, images, PROMPTS, folders["tok"], oc_blocks(sd, "visual.transformer", 2),
                              oc_blocks(sd, "transformer", 2))
    torch.testing.assert_close(torch.tensor(scorer(images, PROMPTS)), (img * txt).sum(-1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["missing", "no_spec", "wrong_type", "blip_mlp", "hps_arch", "mlp_width", "device"])
def test_missing_or_wrong_weights_are_refused_naming_the_path(folders: dict, tmp_path, case: str) -> None:
    import json

    if case == "missing":
        spec, path = {"name": "pickscore", "kwargs": {"model": str(tmp_path / "nope")}}, str(tmp_path / "nope")
    elif case == "no_spec":
        spec, path = "clipscore", "model=<path>"
    elif case == "wrong_type":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "blip"}))
        spec, path = {"name": "pickscore", "kwargs": {"model": str(tmp_path / "m")}}, "'blip'"
    elif case == "blip_mlp":
        torch.save({"x": torch.zeros(2)}, tmp_path / "a.pth")
        spec = {"name": "aesthetic", "kwargs": {"model": str(tmp_path / "a.pth"), "clip": folders["clip"]}}
        path = "layers."
    elif case == "hps_arch":  # the tiny checkpoint given as the published ViT-H-14
        spec = {"name": "hpsv2", "kwargs": {"model": folders["hps"], "tokenizer": folders["tok"]}}
        path = "vision_width 32 (expected 1280)"
    elif case == "device":  # an accelerator this machine does not have: refused, never the CPU instead
        spec, path = {"name": "clipscore", "kwargs": {"model": folders["clip"], "device": "cuda:999"}}, "'cuda:999'"
    else:  # an MLP for 16-wide embeddings on a CLIP giving 24
        save_aesthetic_mlp(str(tmp_path / "a16.pth"), d_in=16)
        spec = {"name": "aesthetic", "kwargs": {"model": str(tmp_path / "a16.pth"), "clip": folders["clip"]}}
        path = "gives 24"
    with pytest.raises(RewardWeightsError) as info:
        build_scorer(spec)
    assert path in str(info.value), str(info.value)


def test_imagereward_checkpoint_layout_and_normalisation(tmp_path, images: list) -> None:
    from transformers import BertTokenizerFast

    from tests.unit.reward_models import imagereward_state_dict, save_bert_tokenizer

    vocab = save_bert_tokenizer(str(tmp_path / "bert"))
    sd, arch, vision, text = imagereward_state_dict(vocab, seed=4)
    torch.save(sd, tmp_path / "ImageReward.pt")
    scorer = build_scorer({"name": "imagereward", "kwargs": {"model": str(tmp_path / "ImageReward.pt"),
                                                             "tokenizer": str(tmp_path / "bert"), "arch": arch}})
    got = torch.tensor(scorer(images, PROMPTS))
    # ImageReward.score: ViT tokens, BERT [CLS] with cross-attention to them (35 tokens), MLP, (x - mean) / std.
    px = torch.stack([ref_pixels(im) for im in images])
    tok = BertTokenizerFast.from_pretrained(str(tmp_path / "bert"))(PROMPTS, padding="max_length", truncation=True,
                                                                   max_length=35, return_tensors="pt")
    with torch.no_grad():
        emb = vision(pixel_values=px).last_hidden_state
        cls = text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], encoder_hidden_states=emb,
                   encoder_attention_mask=torch.ones(emb.shape[:2], dtype=torch.long),
                   is_decoder=False).last_hidden_state[:, 0]
    h = cls
    for i in (0, 2, 4, 6, 7):
        h = h @ sd[f"mlp.layers.{i}.weight"].t() + sd[f"mlp.layers.{i}.bias"]
    want = (h.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(RewardWeightsError, match="vision_width 32 \\(expected 1024\\)"):  # the published arch
        build_scorer({"name": "imagereward", "kwargs": {"model": str(tmp_path / "ImageReward.pt"),
                                                        "tokenizer": str(tmp_path / "bert")}})
