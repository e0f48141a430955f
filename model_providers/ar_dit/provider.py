"""The AR-DiT model provider: a hybrid config (Qwen2 decoder + Qwen-Image DiT + connector), the Megatron
hybrid of one rank, Hugging Face-layout weights in and out, and the torch reference hybrid the embedded
rollout runs (transformers' `Qwen2ForCausalLM`, our `Connector`, diffusers' `QwenImageTransformer2DModel`).

Weights travel as three name spaces: the decoder in Qwen2 names (`model.layers.N...`, `lm_head.weight`), the
connector as `norm.weight`, `proj.weight`, `proj.bias`, the DiT in diffusers names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_omni.models.ar.connector import Connector
from megatron_omni.models.ar.hybrid import ARDiTModel
from model_providers.ar_dit import decoder_provider
from model_providers.ar_dit.decoder_mapping import DecoderMapping, all_decoder_mappings
from model_providers.ar_dit.presets import hybrid_preset
from model_providers.qwen_image import provider as dit_provider
from model_providers.registry import SameNameLayout, WeightPart


@dataclass(frozen=True)
class HybridConfig:
    """decoder: Qwen2 config keys; dit: diffusers transformer config keys; the decoder's eos/pad ids."""

    decoder: dict[str, Any]
    dit: dict[str, Any]
    eos_token_id: int
    pad_token_id: int

    @property
    def decoder_hidden(self) -> int:
        return self.decoder["hidden_size"]

    @property
    def joint_attention_dim(self) -> int:
        return self.dit["joint_attention_dim"]

    def to_dict(self) -> dict[str, Any]:
        return {"decoder": dict(self.decoder), "dit": {k: (list(v) if isinstance(v, tuple) else v)
                                                       for k, v in self.dit.items()},
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}


def hybrid_config(name_or_config: str | dict[str, Any] | HybridConfig) -> HybridConfig:
    """A `HybridConfig` from a preset name ('tiny', '7b+20b') or a dict {decoder, dit, eos_token_id,
    pad_token_id} whose decoder/dit entries are preset names or config dicts."""
    if isinstance(name_or_config, HybridConfig):
        return name_or_config
    raw = hybrid_preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    missing = [k for k in ("decoder", "dit", "eos_token_id", "pad_token_id") if k not in raw]
    if missing:
        raise ValueError(f"AR-DiT config lacks {missing}")
    dec = decoder_provider.qwen2_config(raw["decoder"])
    for key in ("eos_token_id", "pad_token_id"):
        if not 0 <= int(raw[key]) < dec["vocab_size"]:
            raise ValueError(f"{key} {raw[key]} is outside the vocabulary of {dec['vocab_size']}")
    return HybridConfig(decoder=dec, dit=dit_provider.hf_config(raw["dit"]), eos_token_id=int(raw["eos_token_id"]),
                        pad_token_id=int(raw["pad_token_id"]))


def build_model(name_or_config: str | dict[str, Any] | HybridConfig, groups, backend: str = "local",
                params_dtype: torch.dtype = torch.float32, **overrides: Any) -> ARDiTModel:
    """This rank's hybrid (pp = 1; tp over `groups.tp` and context parallelism over `groups.cp` for both halves)."""
    h = hybrid_config(name_or_config)
    lay = groups.layout
    if lay.pp != 1:
        raise ValueError(f"the AR-DiT hybrid is built on one pipeline stage; got pp={lay.pp}")
    dcfg = decoder_provider.transformer_config(h.decoder, tp=lay.tp, cp=lay.cp, params_dtype=params_dtype,
                                               **overrides)
    decoder = decoder_provider.build_decoder(h.decoder, dcfg, groups, backend=backend)
    connector = Connector(h.decoder_hidden, h.joint_attention_dim, eps=h.decoder["rms_norm_eps"]).to(params_dtype)
    tcfg = dit_provider.transformer_config(h.dit, tp=lay.tp, ulysses=lay.ulysses, ring=lay.ring,
                                           params_dtype=params_dtype, **overrides)
    dit = dit_provider.build_model(tcfg, groups, backend=backend)
    return ARDiTModel(decoder, connector, dit)


@torch.no_grad()
def load_hf_state(model: ARDiTModel, decoder_state: dict[str, torch.Tensor],
                  connector_state: dict[str, torch.Tensor], dit_state: dict[str, torch.Tensor]) -> None:
    """Copy full Hugging Face-layout tensors of the three parts into this rank's shards (same dicts on every rank)."""
    decoder_provider.load_hf_state_dict(model.decoder, decoder_state)
    model.connector.load_state_dict(connector_state, strict=True)
    dit_provider.load_hf_state_dict(model.dit, dit_state)


HYBRID_PARTS = ("decoder", "connector", "dit")


def _torch_layout(kind: str) -> SameNameLayout:
    if kind != "diffusers":
        raise KeyError(f"the AR-DiT decoder and connector have no {kind!r} rollout layout in the bridge (they reach "
                       "vLLM engines as full tensors); known: ['diffusers']")
    return SameNameLayout()


def weight_parts(name_or_config: str | dict[str, Any] | HybridConfig) -> dict[str, WeightPart]:
    """The three parts the bridge syncs into the torch hybrid (`TorchHybrid`): the decoder (Qwen2 names into
    transformers' Qwen2ForCausalLM; GQA-fused qkv, SwiGLU gate/up), the connector (same names) and the DiT
    (the Qwen-Image part, into diffusers' transformer or vLLM-Omni's)."""
    h = hybrid_config(name_or_config)
    d = h.decoder
    conn_shapes = {"norm.weight": (h.decoder_hidden,), "proj.weight": (h.joint_attention_dim, h.decoder_hidden),
                   "proj.bias": (h.joint_attention_dim,)}
    connector = [DecoderMapping(n, (n,), "copy", None, None, "pre") for n in conn_shapes]
    return {
        "decoder": WeightPart(all_decoder_mappings(d["num_hidden_layers"], d["tie_word_embeddings"]),
                              decoder_provider.megatron_shapes(d), d["num_attention_heads"], d["num_hidden_layers"],
                              _torch_layout, num_groups=d["num_key_value_heads"]),
        "connector": WeightPart(connector, conn_shapes, 1, 1, _torch_layout),
        "dit": dit_provider.weight_parts(h.dit)["transformer"],
    }


def megatron_sources(model: ARDiTModel) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's Megatron tensors per part (decoder and DiT: local tp shards by global Megatron name; the
    connector is replicated), the parameters' storage."""
    dec = model.decoder.state_dict(keep_vars=True)
    return {"decoder": {m.megatron: dec[name].detach()
                        for name, m in decoder_provider.local_mappings(model.decoder).items()},
            "connector": {n: p.detach() for n, p in model.connector.named_parameters()},
            "dit": dit_provider.megatron_sources(model.dit)["transformer"]}


def hf_state(model: ARDiTModel, parts: tuple[str, ...] = HYBRID_PARTS
             ) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
    """(decoder Qwen2 names, connector, DiT diffusers names) full tensors, gathered over tp (collective); a part
    not in `parts` is None (not gathered: e.g. the DiT when the bridge syncs it)."""
    unknown = set(parts) - set(HYBRID_PARTS)
    if unknown:
        raise ValueError(f"unknown hybrid parts {sorted(unknown)}; expected a subset of {HYBRID_PARTS}")
    return (decoder_provider.stage_hf_tensors(model.decoder) if "decoder" in parts else None,
            {k: v.detach() for k, v in model.connector.state_dict().items()} if "connector" in parts else None,
            dit_provider.stage_hf_tensors(model.dit) if "dit" in parts else None)


@dataclass
class TorchHybrid:
    """The hybrid in Hugging Face modules (one process, no parallelism): what the embedded rollout runs."""

    config: HybridConfig
    decoder: nn.Module  # transformers Qwen2ForCausalLM
    connector: Connector
    dit: nn.Module  # diffusers QwenImageTransformer2DModel

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(decoder, connector, dit) state dicts in Hugging Face layouts."""
        return self.decoder.state_dict(), self.connector.state_dict(), self.dit.state_dict()

    @torch.no_grad()
    def load(self, decoder: dict[str, torch.Tensor], connector: dict[str, torch.Tensor],
             dit: dict[str, torch.Tensor] | None) -> None:
        """Load the parts; raises on a missing or unexpected name (nothing is skipped silently). `dit` None:
        the DiT is loaded by the caller (the trainer's bridge writes it in place)."""
        parts = ((self.decoder, decoder), (self.connector, connector)) + (((self.dit, dit),) if dit is not None else ())
        for module, state in parts:
            own = module.state_dict()
            if self.config.decoder["tie_word_embeddings"] and module is self.decoder:
                own.pop("lm_head.weight", None)
            if set(own) != set(state):
                raise KeyError(f"{type(module).__name__}: missing {sorted(set(own) - set(state))[:5]}, "
                               f"unexpected {sorted(set(state) - set(own))[:5]}")
            for k, v in state.items():
                own[k].copy_(v)


def torch_hybrid(name_or_config: str | dict[str, Any] | HybridConfig, seed: int = 0, std: float = 0.2) -> TorchHybrid:
    """The reference hybrid with seeded random weights (fp32): N(0, std) weights, norms N(1, 0.1)."""
    from diffusers import QwenImageTransformer2DModel

    h = hybrid_config(name_or_config)
    decoder = decoder_provider.hf_model(h.decoder, seed=seed, std=std)
    torch.manual_seed(seed + 1)
    connector = Connector(h.decoder_hidden, h.joint_attention_dim, eps=h.decoder["rms_norm_eps"])
    dit = QwenImageTransformer2DModel(**h.dit).float().eval()
    with torch.no_grad():
        for module in (connector, dit):
            for name, p in module.named_parameters():
                if name.endswith("norm.weight") or ".norm_" in name:
                    p.normal_(1.0, 0.1)
                else:
                    p.normal_(0.0, std)
    return TorchHybrid(config=h, decoder=decoder, connector=connector, dit=dit)


def megatron_shapes(name_or_config: str | dict[str, Any] | HybridConfig) -> dict[str, int]:
    """Parameter counts per part of the full hybrid (decoder, connector, dit, total), from the config alone."""
    h = hybrid_config(name_or_config)
    d = h.decoder
    hid, ffn, v = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
    hd = hid // d["num_attention_heads"]
    kv = d["num_key_value_heads"] * hd
    per_layer = 2 * hid + (hid + 2 * kv) * (hid + 1) + hid * hid + 3 * hid * ffn
    dec = v * hid * (1 if d["tie_word_embeddings"] else 2) + d["num_hidden_layers"] * per_layer + hid
    conn = hid + hid * h.joint_attention_dim + h.joint_attention_dim
    dit = dit_provider.parameter_count(h.dit)
    return {"decoder": dec, "connector": conn, "dit": dit, "total": dec + conn + dit}
