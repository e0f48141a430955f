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

from megatron_omni.models.patterns import matches_any
from megatron_omni.planner.arch import DiTArch, arch_of
from megatron_omni.planner.memory import lora_linears

# Qwen-Image's and SD3's VAEs downsample 8x; the transformer then packs 2x2 latent patches into one token.
VAE_SCALE_FACTOR = 8


def image_tokens(model: str | dict[str, Any] | DiTArch, height: int, width: int,
                 vae_scale_factor: int = VAE_SCALE_FACTOR) -> int:
    """Image tokens of one `height x width` image: (height / (vae * patch)) * (width / (vae * patch))."""
    patch = arch_of(model).patch
    step = vae_scale_factor * patch
    for name, value in (("height", height), ("width", width)):
        if value < step or value % step:
            raise ValueError(f"image {name} {value} must be a positive multiple of vae_scale_factor * patch_size "
                             f"= {vae_scale_factor} * {patch} = {step}")
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


def forward_flops(model: str | dict[str, Any] | DiTArch, image_tokens: int, text_tokens: int) -> ForwardFlops:
    """FLOPs of one forward pass of one sample with `image_tokens` image and `text_tokens` text tokens.

    SD3 (`DiTArch`): the patch embedding's convolution ([h, c, p, p]) counts as a linear on image tokens, the
    pooled embedder once per sample; the second image attention of the dual-attention blocks (`img_attn2`) acts
    on image tokens and adds `4 s_img^2 h`; the last block's text queries do attend (diffusers computes them).
    FLUX: the last double block's text stream runs whole, each single block's linears act on [text; image] and its
    attention adds `4 s^2 h`; the guidance embedder acts once per sample."""
    if image_tokens < 1 or text_tokens < 0:
        raise ValueError(f"need image_tokens >= 1 and text_tokens >= 0, got {image_tokens}, {text_tokens}")
    a = arch_of(model)
    cfg = a.config
    img = txt = sample = qkv = 0.0
    for name, shape in a.shapes.items():
        if name in a.buffers or (len(shape) != 2 and name not in a.image_weights):
            continue  # biases, norm scales and constant tables: elementwise, not counted
        macs = math.prod(shape)
        if name.startswith("single_layers."):  # FLUX: on [text; image], adaLN once per sample
            if name.split(".", 2)[2].startswith("adaln."):
                sample += 2 * macs
                continue
            if name.split(".", 2)[2].startswith("linear_qkv."):
                qkv += 2 * macs * (image_tokens + text_tokens)
            img += 2 * macs * image_tokens
            txt += 2 * macs * text_tokens
            continue
        if name.startswith("layers."):
            layer, stream, tensor = int(name.split(".")[1]), name.split(".")[2], name.split(".", 3)[3]
            if tensor.startswith("adaln."):
                sample += 2 * macs
                continue
            if (stream == "txt" and layer == cfg["num_layers"] - 1 and not a.text_output_last
                    and not tensor.startswith("linear_qkv.")):
                continue
            tokens = text_tokens if stream == "txt" else image_tokens
            flops = 2 * macs * tokens
            if tensor.startswith("linear_qkv."):
                qkv += flops
            if stream == "txt":
                txt += flops
            else:
                img += flops
        elif name in a.image_weights:
            img += 2 * macs * image_tokens
        elif name in a.text_weights:
            txt += 2 * macs * text_tokens
        elif name in a.sample_weights:
            sample += 2 * macs
        else:
            raise ValueError(f"planner FLOPs model does not know where weight {name} {shape} applies")
    hidden = a.hidden
    seq = image_tokens + text_tokens
    # Qwen-Image's last block runs image queries only (its text queries' outputs would feed nothing).
    last_queries = seq if a.last_text_queries else image_tokens
    attention = 4.0 * seq * hidden * (seq * (a.layers - 1) + last_queries)
    attention += 4.0 * image_tokens * image_tokens * hidden * len(a.image_attention_layers)
    attention += 4.0 * seq * seq * hidden * a.single_layers
    return ForwardFlops(image_linear=img, text_linear=txt, per_sample=sample, attention=attention, qkv_linear=qkv)


def lora_forward_flops(model: str | dict[str, Any] | DiTArch, image_tokens: int, text_tokens: int, rank: int,
                       targets: Sequence[str], tp: int = 1) -> ForwardFlops:
    """FLOPs of the LoRA adapters' forward (`A x`, then `B (A x)`) on the linears matching `targets`, one sample,
    split like `forward_flops` (qkv_linear: the QKV adapters', which selective recompute runs again).

    At tp=1 this is the whole model's count. At tp > 1 it is scaled so that `per_rank(tp, cp, pp)` is what one
    rank computes: the factor a layer keeps whole (A of a column-parallel layer, B of a row-parallel one) runs
    on every tp rank, so it counts tp times here."""
    a = arch_of(model)
    cfg = a.config
    img = txt = sample = qkv = 0.0
    for name, (n_out, n_in, row) in lora_linears(a).items():
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
        flops = 2 * macs * (text_tokens if stream == "txt" else image_tokens)
        if linear == "linear_qkv":
            qkv += flops
        if stream == "txt":
            txt += flops
        else:
            img += flops
    return ForwardFlops(image_linear=img, text_linear=txt, per_sample=sample, attention=0.0, qkv_linear=qkv)
