"""The shared FLUX.1 parity check: diffusers' `FluxTransformer2DModel` (tiny preset: two double-stream and two
single-stream blocks, the guidance embedding) against our Megatron model with the same weights, forward and backward,
on any tensor-parallel layout. Used in one process (tests/unit) and on spawned gloo ranks (tests/distributed)."""

from __future__ import annotations

import torch
from diffusers import FluxTransformer2DModel

from megatron_omni.models.dit.flux_interface import flux_image_ids
from model_providers.flux import provider
from tests.unit import sd3_reference

GRID = (3, 4)  # a non-square patch grid of packed 2x2 latent patches
S_TXT = 5
BATCH = 2


def reference_model(dtype: torch.dtype = torch.float32, config: dict | None = None) -> FluxTransformer2DModel:
    """The tiny diffusers transformer (or `config`), seeded; every parameter N(0, 0.2) (adaLN and the output are
    zero-initialised by default, which would hide the blocks)."""
    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**(config or provider.hf_config("tiny")))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    return ref if dtype == torch.float32 else ref.to(dtype)


def batch() -> dict[str, torch.Tensor]:
    """Packed latents [b, s, 64], prompt embeddings [b, s_txt, joint], pooled [b, pooled], sigma [b] in (0, 1), the
    guidance scale [b] and a random loss weight on the output."""
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    s = GRID[0] * GRID[1]
    return dict(
        latents=torch.randn(BATCH, s, cfg["in_channels"], generator=g),
        prompt_embeds=torch.randn(BATCH, S_TXT, cfg["joint_attention_dim"], generator=g),
        pooled=torch.randn(BATCH, cfg["pooled_projection_dim"], generator=g),
        sigma=torch.rand(BATCH, generator=g),
        guidance=3.5 + torch.rand(BATCH, generator=g),
        weight=torch.randn(BATCH, s, cfg["out_channels"], generator=g),
    )


def parity(groups, dtype: torch.dtype = torch.float32) -> dict:
    """Run both models on `batch()` (forward, then backward of the weighted sum); return the forward's max abs
    and relative error, the relative error of every diffusers parameter's gradient rebuilt from this rank's
    shards, the names of nonzero gradients diffusers lacks, and the load -> export round trip's mismatches."""
    from megatron_omni.models.dit.model import DiTBatch
    from megatron_omni.parallel.platform import seed_everything

    b = batch()
    ref = reference_model(dtype)
    ref_out = ref(hidden_states=b["latents"].to(dtype), encoder_hidden_states=b["prompt_embeds"].to(dtype),
                  pooled_projections=b["pooled"].to(dtype), timestep=b["sigma"].to(dtype),
                  img_ids=flux_image_ids(*GRID), txt_ids=torch.zeros(S_TXT, 3), guidance=b["guidance"],
                  return_dict=False)[0]
    (ref_out.float() * b["weight"]).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None and p.grad.any()}

    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(provider.transformer_config("tiny", tp=groups.layout.tp, params_dtype=dtype), groups)
    return sd3_reference.compare(
        groups, provider, model, reference_model(dtype).state_dict(),
        lambda: model(DiTBatch(b["latents"], b["prompt_embeds"], None, b["sigma"], (1, *GRID), pooled=b["pooled"],
                               guidance=b["guidance"])), b["weight"], ref_out, ref_grads)
