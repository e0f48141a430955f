"""The AR decoder provider: a Hugging Face Qwen2 config -> Megatron `TransformerConfig`, the decoder stage of
one rank, loading Qwen2-named weights into the shards and gathering them back."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omni.models.ar.decoder import ARDecoder, decoder_layer_spec
from megatron_omni.parallel.platform import megatron_config_defaults
from model_providers.ar_dit.decoder_mapping import (
    DecoderMapping,
    all_decoder_mappings,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
)
from model_providers.ar_dit.presets import decoder_preset

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings")


def qwen2_config(name_or_config: str | dict[str, Any] | Any) -> dict[str, Any]:
    """The architecture keys of a Qwen2 config, from a preset name, a dict or a transformers `Qwen2Config`.

    Raises ValueError for Qwen2 options this decoder does not reproduce (sliding window, rope scaling,
    an activation other than SiLU).
    """
    if isinstance(name_or_config, str):
        cfg = decoder_preset(name_or_config)
    elif isinstance(name_or_config, dict):
        cfg = dict(name_or_config)
    else:
        cfg = name_or_config.to_dict()
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ValueError(f"Qwen2 rope scaling is not supported: {rope or cfg.get('rope_scaling')}")
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Qwen2 hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU uses silu)")
    cfg.setdefault("num_key_value_heads", cfg.get("num_attention_heads"))
    cfg.setdefault("tie_word_embeddings", False)
    missing = [k for k in _KEYS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"Qwen2 config lacks {missing}")
    return {k: cfg[k] for k in _KEYS}


def transformer_config(
    name_or_config: str | dict[str, Any] | Any,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """The Megatron `TransformerConfig` of a Qwen2 decoder for a parallel layout."""
    c = qwen2_config(name_or_config)
    if c["num_key_value_heads"] % tp:
        raise ValueError(f"{c['num_key_value_heads']} query groups are not divisible by tp={tp}")
    if c["num_attention_heads"] % (tp * cp):
        raise ValueError(f"{c['num_attention_heads']} attention heads are not divisible by tp * cp = {tp * cp}")
    if c["vocab_size"] % tp:
        raise ValueError(f"vocabulary {c['vocab_size']} is not divisible by tp={tp}")
    kwargs: dict[str, Any] = dict(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"],
        kv_channels=c["hidden_size"] // c["num_attention_heads"],
        normalization="RMSNorm",
        layernorm_epsilon=c["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
    )
    kwargs.update(megatron_config_defaults())
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_decoder(name_or_config: str | dict[str, Any] | Any, config: TransformerConfig, groups,
                  backend: str = "local") -> ARDecoder:
    """This rank's stage of the decoder (`groups`: `megatron_omni.parallel.ParallelGroups`)."""
    c = qwen2_config(name_or_config)
    groups.layout.validate_model(num_heads=config.num_attention_heads, num_layers=config.num_layers)
    spec = decoder_layer_spec(backend, context_parallel=groups.layout.cp > 1)
    return ARDecoder(config, spec, c["vocab_size"], c["max_position_embeddings"],
                     c["rope_theta"], groups, share_embeddings_and_output_weights=c["tie_word_embeddings"])


def megatron_shapes(name_or_config: str | dict[str, Any] | Any) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every Megatron decoder tensor, from the config alone."""
    c = qwen2_config(name_or_config)
    hid, ffn, n, g = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = hid // n
    layer = {"input_layernorm.weight": (hid,), "self_attention.linear_qkv.weight": ((n + 2 * g) * d, hid),
             "self_attention.linear_qkv.bias": ((n + 2 * g) * d,), "self_attention.linear_proj.weight": (hid, n * d),
             "pre_mlp_layernorm.weight": (hid,), "mlp.linear_fc1.weight": (2 * ffn, hid),
             "mlp.linear_fc2.weight": (hid, ffn)}
    out = {"embedding.word_embeddings.weight": (c["vocab_size"], hid), "decoder.final_layernorm.weight": (hid,)}
    for i in range(c["num_hidden_layers"]):
        out.update({f"decoder.layers.{i}.{k}": v for k, v in layer.items()})
    if not c["tie_word_embeddings"]:
        out["output_layer.weight"] = (c["vocab_size"], hid)
    return out


def local_mappings(model: ARDecoder) -> dict[str, DecoderMapping]:
    """Local parameter name -> mapping, for the tensors this pipeline stage holds."""
    cfg = model.config
    by_global = {m.megatron: m for m in all_decoder_mappings(cfg.num_layers, model.share_embeddings_and_output_weights)}
    out = {}
    for name in model.state_dict():
        if name.endswith("_extra_state"):
            continue
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            continue
        out[name] = by_global[_global_name(name, model.layer_offset)]
    return out


def _global_name(local: str, offset: int) -> str:
    prefix = "decoder.layers."
    if local.startswith(prefix):
        idx, rest = local[len(prefix):].split(".", 1)
        return f"{prefix}{int(idx) + offset}.{rest}"
    return local


@torch.no_grad()
def load_mapped_tensors(model: Any, mappings: dict[str, DecoderMapping], hf_state: dict[str, torch.Tensor],
                        what: str = "Qwen2") -> None:
    """Copy full Hugging Face-layout tensors into this rank's shards of `model` by `mappings` (local parameter
    name -> mapping; every rank passes the same dict). `model` is a Megatron decoder stage with `config`,
    `pg_collection.tp` and the mapped parameters (ours: `ARDecoder`, BAGEL's `BagelMoT`); `what` names the
    source layout in errors."""
    cfg = model.config
    tp = model.pg_collection.tp
    state = model.state_dict()
    for name, m in mappings.items():
        missing = [k for k in m.hf if k not in hf_state]
        if missing:
            raise KeyError(f"{what} state dict lacks {missing} (needed for {m.megatron})")
        shard = hf_to_megatron_shard(m, [hf_state[k] for k in m.hf], cfg.num_attention_heads, cfg.num_query_groups,
                                     tp.rank(), tp.size())
        if shard.shape != state[name].shape:
            raise ValueError(f"{m.hf[0]}: gives shard {tuple(shard.shape)}, model expects "
                             f"{tuple(state[name].shape)} for {name}")
        state[name].copy_(shard)


def gather_mapped_tensors(model: Any, mappings: dict[str, DecoderMapping],
                          tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full Hugging Face-layout tensors of this stage by `mappings`, gathered over tp (collective over tp).
    `tensors` defaults to the model's parameters; pass e.g. `{name: p.grad}` to map gradients."""
    cfg = model.config
    tp = model.pg_collection.tp
    source = tensors if tensors is not None else dict(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for name, m in mappings.items():
        if source.get(name) is None:
            continue
        local = source[name].detach().contiguous()
        if m.tp_dim is None or tp.size() == 1:
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(tp.size())]
            dist.all_gather(shards, local, group=tp)
        for hf_name, t in zip(m.hf, megatron_shards_to_hf(m, shards, cfg.num_attention_heads, cfg.num_query_groups)):
            out[hf_name] = t
    return out


def load_hf_state_dict(model: ARDecoder, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy Qwen2-named full tensors into this rank's shards (every rank passes the same dict)."""
    load_mapped_tensors(model, local_mappings(model), hf_state)


def stage_hf_tensors(model: ARDecoder, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Qwen2-named full tensors of this pipeline stage, gathered over tp (collective over tp).

    `tensors` defaults to the model's parameters; pass e.g. `{name: p.grad}` to map gradients.
    """
    return gather_mapped_tensors(model, local_mappings(model), tensors)


def hf_model(name_or_config: str | dict[str, Any] | Any, seed: int = 0, std: float = 0.2):
    """A transformers `Qwen2ForCausalLM` of the config with seeded random weights (fp32, eager attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = qwen2_config(name_or_config)
    torch.manual_seed(seed)
    hf_cfg = Qwen2Config(**c, hidden_act="silu", attn_implementation="eager")
    model = Qwen2ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, std)
    return model
