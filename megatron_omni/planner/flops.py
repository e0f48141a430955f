"""FLOPs of one MMDiT forward pass, counted from the provider's tensor shapes (part of the dry-run planner).

A weight matrix `[out, in]` applied to `n` tokens costs `2 * out * in * n` FLOPs (multiply + add); biases,
norms, RoPE, activations and gates are elementwise and left out (well under 1% here). Which tokens a
weight sees depends on where it sits: image-stream block weights, `img_in` and `proj_out` act on image
tokens; text-stream block weights and `txt_in` on text tokens; adaLN, `norm_out.linear` and the timestep
embedder act once per sample (on the timestep embedding). Joint attention costs `4 * s^2 * h` per block
(`Q K^T` and `P V`, `s = s_img + s_txt`). The last block's text-stream output projection and MLP and its text
queries' attention are not counted: the model skips them (`MMDiTLayer(text_output=False)`), as nothing reads
that stream afterwards (its text keys and values still feed the image queries: `4 s_img s h` there).

The split into parts matters for context parallelism: image tokens and attention divide over the CP
ranks, while the (short) text stream and the per-sample layers are replicated on every CP rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_omni.models.lora import matches_any
from megatron_omni.planner.memory import lora_linears
from model_providers.qwen_image.provider import hf_config, megatron_shapes

# Qwen-Image's VAE downsamples 8x; the transformer then packs 2x2 latent patches into one token.
VAE_SCALE_FACTOR = 8

_IMAGE_WEIGHTS = ("img_in.weight", "proj_out.weight")
_TEXT_WEIGHTS = ("txt_in.weight",)
_SAMPLE_WEIGHTS = ("time_embedder.linear_1.weight", "time_embedder.linear_2.weight", "norm_out.linear.weight")


def image_tokens(model: str | dict[str, Any], height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR
                 ) -> int:
    """Image tokens of one `height x width` image: (height / (vae * patch)) * (width / (vae * patch))."""
    cfg = hf_config(model)
    step = vae_scale_factor * cfg["patch_size"]
    for name, value in (("height", height), ("width", width)):
        if value < step or value % step:
            raise ValueError(f"image {name} {value} must be a positive multiple of vae_scale_factor * patch_size "
                             f"= {vae_scale_factor} * {cfg['patch_size']} = {step}")
    return (height // step) * (width // step)


@dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of one forward pass of one sample, split by what they scale with.

    image_linear: weights applied to image tokens (divides over CP)
    text_linear: weights applied to text tokens (replicated on every CP rank)
    per_sample: adaLN / timestep / final-norm weights applied once per sample (replicated over CP)
    attention: joint attention `4 s^2 h` per block (divides over CP)
    qkv_linear: the QKV projections of both streams (part of image_linear + text_linear); selective
        recompute (checkpointing `_attention`) runs them and the attention again in the backward pass
    """

    image_linear: float
    text_linear: float
    per_sample: float
    attention: float
    qkv_linear: float

    @property
    def total(self) -> float:
        """All FLOPs of the forward pass (one sample, one GPU doing everything)."""
        return self.image_linear + self.text_linear + self.per_sample + self.attention

    @property
    def selective_recompute(self) -> float:
        """Extra forward FLOPs that selective recompute adds to one backward pass."""
        return self.qkv_linear + self.attention

    def per_rank(self, tp: int, cp: int, pp: int) -> float:
        """FLOPs one rank of a `tp x cp x pp` model replica spends on this sample's forward pass.

        Everything divides over tp and over pp (blocks dominate; the embedders are small); image tokens and
        attention also divide over cp, while text tokens and per-sample layers are recomputed by each CP rank.
        """
        split = (self.image_linear + self.attention) / cp + self.text_linear + self.per_sample
        return split / (tp * pp)


def forward_flops(model: str | dict[str, Any], image_tokens: int, text_tokens: int) -> ForwardFlops:
    """FLOPs of one forward pass of one sample with `image_tokens` image and `text_tokens` text tokens."""
    if image_tokens < 1 or text_tokens < 0:
        raise ValueError(f"need image_tokens >= 1 and text_tokens >= 0, got {image_tokens}, {text_tokens}")
    cfg = hf_config(model)
    shapes = megatron_shapes(cfg)
    img = txt = sample = qkv = 0.0
    for name, shape in shapes.items():
        if len(shape) != 2:  # biases and norm scales: elementwise, not counted
            continue
        macs = math.prod(shape)
        if name.startswith("layers."):
            layer, stream, tensor = int(name.split(".")[1]), name.split(".")[2], name.split(".", 3)[3]
            if tensor.startswith("adaln."):
                sample += 2 * macs
                continue
            if stream == "txt" and layer == cfg["num_layers"] - 1 and not tensor.startswith("linear_qkv."):
                continue
            tokens = image_tokens if stream == "img" else text_tokens
            flops = 2 * macs * tokens
            if tensor.startswith("linear_qkv."):
                qkv += flops
            if stream == "img":
                img += flops
            else:
                txt += flops
        elif name in _IMAGE_WEIGHTS:
            img += 2 * macs * image_tokens
        elif name in _TEXT_WEIGHTS:
            txt += 2 * macs * text_tokens
        elif name in _SAMPLE_WEIGHTS:
            sample += 2 * macs
        else:
            raise ValueError(f"planner FLOPs model does not know where weight {name} {shape} applies")
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    seq = image_tokens + text_tokens
    # The last block runs image queries only (its text queries' outputs would feed nothing).
    attention = 4.0 * seq * hidden * (seq * (cfg["num_layers"] - 1) + image_tokens)
    return ForwardFlops(image_linear=img, text_linear=txt, per_sample=sample, attention=attention, qkv_linear=qkv)


def lora_forward_flops(model: str | dict[str, Any], image_tokens: int, text_tokens: int, rank: int,
                       targets: Sequence[str], tp: int = 1) -> ForwardFlops:
    """FLOPs of the LoRA adapters' forward (`A x`, then `B (A x)`) on the linears matching `targets`, one sample,
    split like `forward_flops` (qkv_linear: the QKV adapters', which selective recompute runs again).

    At tp=1 this is the whole model's count. At tp > 1 it is scaled so that `per_rank(tp, cp, pp)` is what one
    rank computes: the factor a layer keeps whole (A of a column-parallel layer, B of a row-parallel one) runs
    on every tp rank, so it counts tp times here."""
    cfg = hf_config(model)
    img = txt = sample = qkv = 0.0
    for name, (n_out, n_in, row) in lora_linears(cfg).items():
        if not matches_any(name, targets):
            continue
        _, layer, stream, linear = name.split(".")
        # MACs per token one rank does, times tp: the split factor's share sums to its whole, the replicated
        # factor's is whole on each rank.
        macs = rank * (n_in * tp + n_out) if not row else rank * (n_in + n_out * tp)
        if linear == "adaln":
            sample += 2 * macs
            continue
        if stream == "txt" and int(layer) == cfg["num_layers"] - 1 and linear != "linear_qkv":
            continue
        flops = 2 * macs * (image_tokens if stream == "img" else text_tokens)
        if linear == "linear_qkv":
            qkv += flops
        if stream == "img":
            img += flops
        else:
            txt += flops
    return ForwardFlops(image_linear=img, text_linear=txt, per_sample=sample, attention=0.0, qkv_linear=qkv)
