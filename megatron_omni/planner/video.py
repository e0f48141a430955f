"""The Wan video DiT's cost model for the dry-run planner: video tokens of a clip and the FLOPs of one forward,
split the way the planner splits the MMDiT's (`flops.ForwardFlops`), so context parallelism divides what scales
with the video tokens and replicates the rest.

A weight `[out, in]` applied to n tokens costs `2 out in n`; biases, norms, RoPE, activations and the
modulation are elementwise and left out. Per block: self-attention q/k/v and output projection, the
cross-attention's query and output projection, and the MLP act on the video tokens; the cross-attention's keys
and values on the text tokens; the softmax attention costs `4 s_v^2 h` (self) plus `4 s_v s_t h` (cross, its
queries the video's, so it divides over CP too). The patch embedding and `proj_out` act on the video tokens,
the text embedder on the text tokens, the timestep embedder and projection once per sample.

Parameter counts per rank are the provider's exact ones (`model_providers.wan.provider.per_rank_parameter_counts`);
the rollout weights per GPU come from the bridge's plan into the engine's layout (what the sync writes).
"""

from __future__ import annotations

import math
from typing import Any

from megatron_omni.planner.flops import ForwardFlops
from model_providers.wan.provider import hf_config, megatron_shapes

# Wan2.1's VAE compresses 4x in time and 8x in space (Wan2.2-TI2V-5B's: 4 x 16 x 16).
VAE_TEMPORAL, VAE_SPATIAL = 4, 8

_VIDEO = ("patch_embedding.", "proj_out.")
_TEXT = ("text_embedder.",)
_SAMPLE = ("time_embedder.", "time_proj.")
_TEXT_IN_BLOCK = ("cross_attention.linear_k.", "cross_attention.linear_v.")
_QKV_IN_BLOCK = ("self_attention.linear_qkv.", "cross_attention.linear_q.", "cross_attention.linear_k.",
                 "cross_attention.linear_v.")


def video_grid(model: str | dict[str, Any], frames: int, height: int, width: int, vae_temporal: int = VAE_TEMPORAL,
               vae_spatial: int = VAE_SPATIAL) -> tuple[int, int, int]:
    """The transformer's patch grid (f, h, w) of a `frames`-frame `height x width` clip: latent frames
    (frames - 1) / t + 1, then the 3D patches. Raises ValueError naming a size that does not divide."""
    pt, ph, pw = hf_config(model)["patch_size"]
    if frames < 1 or (frames - 1) % vae_temporal:
        raise ValueError(f"frames - 1 must be a multiple of the VAE's temporal factor {vae_temporal}, got {frames}")
    latent_f = (frames - 1) // vae_temporal + 1
    if latent_f % pt:
        raise ValueError(f"{latent_f} latent frames do not split into temporal patches of {pt}")
    for name, value, p in (("height", height, ph), ("width", width, pw)):
        if value < vae_spatial * p or value % (vae_spatial * p):
            raise ValueError(f"{name} {value} must be a positive multiple of {vae_spatial} * {p}")
    return latent_f // pt, height // (vae_spatial * ph), width // (vae_spatial * pw)


def wan_forward_flops(model: str | dict[str, Any], video_tokens: int, text_tokens: int) -> ForwardFlops:
    """FLOPs of one Wan forward of one sample (`image_linear` holds the video tokens' linears)."""
    if video_tokens < 1 or text_tokens < 1:
        raise ValueError(f"need video_tokens >= 1 and text_tokens >= 1, got {video_tokens}, {text_tokens}")
    cfg = hf_config(model)
    video = text = sample = qkv = 0.0
    for name, shape in megatron_shapes(cfg).items():
        if not name.endswith("weight") or len(shape) < 2:
            continue  # biases, norm scales and the modulation tables (not "weight"s): elementwise
        macs = math.prod(shape)
        tensor = name.split(".", 2)[2] if name.startswith("layers.") else name
        if name.startswith("layers."):
            on_text = tensor.startswith(_TEXT_IN_BLOCK)
            flops = 2 * macs * (text_tokens if on_text else video_tokens)
            if tensor.startswith(_QKV_IN_BLOCK):
                qkv += flops
            if on_text:
                text += flops
            else:
                video += flops
        elif name.startswith(_VIDEO):
            video += 2 * macs * video_tokens
        elif name.startswith(_TEXT):
            text += 2 * macs * text_tokens
        elif name.startswith(_SAMPLE):
            sample += 2 * macs
        else:
            raise ValueError(f"planner FLOPs model does not know where weight {name} {shape} applies")
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    attention = 4.0 * video_tokens * hidden * (video_tokens + text_tokens) * cfg["num_layers"]
    return ForwardFlops(image_linear=video, text_linear=text, per_sample=sample, attention=attention, qkv_linear=qkv)
