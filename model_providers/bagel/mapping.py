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

FROZEN_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.")


def _expert(layer: int, gen: bool) -> list[DecoderMapping]:
    s, g = ("_gen", "_moe_gen") if gen else ("", "")
    m, h = f"decoder.layers.{layer}.", f"language_model.model.layers.{layer}."
    a = f"{h}self_attn."
    mlp = f"{h}mlp{g}."
    out = [
        DecoderMapping(f"{m}input_layernorm{s}.weight", (f"{h}input_layernorm{g}.weight",), "copy", None, layer,
                       "block"),
        DecoderMapping(f"{m}self_attention.linear_qkv{s}.weight",
                       (f"{a}q_proj{g}.weight", f"{a}k_proj{g}.weight", f"{a}v_proj{g}.weight"), "fuse_qkv", 0,
                       layer, "block"),
        DecoderMapping(f"{m}self_attention.linear_qkv{s}.bias",
                       (f"{a}q_proj{g}.bias", f"{a}k_proj{g}.bias", f"{a}v_proj{g}.bias"), "fuse_qkv", 0, layer,
                       "block"),
        DecoderMapping(f"{m}self_attention.linear_proj{s}.weight", (f"{a}o_proj{g}.weight",), "copy", 1, layer,
                       "block"),
        DecoderMapping(f"{m}pre_mlp_layernorm{s}.weight", (f"{h}post_attention_layernorm{g}.weight",), "copy", None,
                       layer, "block"),
        DecoderMapping(f"{m}mlp{s}.linear_fc1.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),
                       "fuse_gate_up", 0, layer, "block"),
        DecoderMapping(f"{m}mlp{s}.linear_fc2.weight", (f"{mlp}down_proj.weight",), "copy", 1, layer, "block"),
    ]
    return out


def layer_mappings(layer: int, qk_norm: bool = True) -> list[DecoderMapping]:
    """Both experts' tensors of decoder layer `layer` (global index)."""
    out = _expert(layer, False) + _expert(layer, True)
    if qk_norm:
        h = f"language_model.model.layers.{layer}.self_attn."
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
        one("embedding.word_embeddings.weight", "language_model.model.embed_tokens.weight", 0, "pre"),
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
        one("decoder.final_layernorm.weight", "language_model.model.norm.weight", None, "post"),
        one("decoder.final_layernorm_gen.weight", "language_model.model.norm_moe_gen.weight", None, "post"),
        one("llm2vae.weight", "llm2vae.weight", None, "post"),
        one("llm2vae.bias", "llm2vae.bias", None, "post"),
        one("output_layer.weight", "language_model.lm_head.weight", 0, "post"),
    ]
    return out
