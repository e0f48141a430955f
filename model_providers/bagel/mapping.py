"""Weight names between BAGEL's published `ema.safetensors` and our Megatron `BagelMoT`, as data (the mapping
kinds and tensor functions are the Qwen2 decoder's: `model_providers.ar_dit.decoder_mapping`).

BAGEL's names: the LLM under `language_model.` in Qwen2's layout, each generation-expert tensor beside its
understanding twin with the suffix `_moe_gen` (`self_attn.q_proj_moe_gen`, `mlp_moe_gen.gate_proj`,
`input_layernorm_moe_gen`, `self_attn.q_norm_moe_gen`, `model.norm_moe_gen`, ...); the generation-side modules
at the top level (`time_embedder.mlp.0/2`, `vae2llm`, `llm2vae`, `latent_pos_embed.pos_embed`). The ViT
(`vit_model.*`), its `connector.*` and `vit_pos_embed.pos_embed` are not in our Megatron model (t2i does not
use them; they stay a frozen replicated module): `FROZEN_PREFIXES` names them for code that carries them along.
"""

from __future__ import annotations

from model_providers.ar_dit.decoder_mapping import DecoderMapping
from model_providers.ar_dit.decoder_mapping import layer_mappings as qwen2_layer_mappings

FROZEN_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.")
LLM_ROOT = "language_model.model."  # the Qwen2 model's names in ema.safetensors


def layer_mappings(layer: int, qk_norm: bool = True) -> list[DecoderMapping]:
    """Both experts' tensors of decoder layer `layer` (global index)."""
    out = (qwen2_layer_mappings(layer, LLM_ROOT)
           + qwen2_layer_mappings(layer, LLM_ROOT, meg_suffix="_gen", hf_suffix="_moe_gen"))
    if qk_norm:
        h = f"{LLM_ROOT}layers.{layer}.self_attn."
        for s, g in (("", ""), ("_gen", "_moe_gen")):
            for which in ("q", "k"):
                out.append(DecoderMapping(f"decoder.layers.{layer}.self_attention.{which}_layernorm{s}.weight",
                                          (f"{h}{which}_norm{g}.weight",), "copy", None, layer, "block"))
    return out


def all_mappings(num_layers: int, qk_norm: bool = True) -> list[DecoderMapping]:
    """Every tensor of BAGEL's language model and generation side, in a stable order."""
    def one(meg: str, hf: str, tp_dim: int | None, stage: str) -> DecoderMapping:
        return DecoderMapping(meg, (hf,), "copy", tp_dim, None, stage)

    out = [
        one("embedding.word_embeddings.weight", f"{LLM_ROOT}embed_tokens.weight", 0, "pre"),
        one("time_embedder.linear_1.weight", "time_embedder.mlp.0.weight", None, "pre"),
        one("time_embedder.linear_1.bias", "time_embedder.mlp.0.bias", None, "pre"),
        one("time_embedder.linear_2.weight", "time_embedder.mlp.2.weight", None, "pre"),
        one("time_embedder.linear_2.bias", "time_embedder.mlp.2.bias", None, "pre"),
        one("vae2llm.weight", "vae2llm.weight", None, "pre"),
        one("vae2llm.bias", "vae2llm.bias", None, "pre"),
        one("latent_pos_embed", "latent_pos_embed.pos_embed", None, "pre"),
    ]
    for layer in range(num_layers):
        out.extend(layer_mappings(layer, qk_norm))
    out += [
        one("decoder.final_layernorm.weight", f"{LLM_ROOT}norm.weight", None, "post"),
        one("decoder.final_layernorm_gen.weight", f"{LLM_ROOT}norm_moe_gen.weight", None, "post"),
        one("llm2vae.weight", "llm2vae.weight", None, "post"),
        one("llm2vae.bias", "llm2vae.bias", None, "post"),
        one("output_layer.weight", "language_model.lm_head.weight", 0, "post"),
    ]
    return out
