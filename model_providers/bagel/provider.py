"""The BAGEL provider: a BAGEL config (preset or published folder) -> Megatron `TransformerConfig` and
`BagelArch`, this rank's `BagelMoT` stage, BAGEL-named weights into the shards and gathered back, and the
offline tiny BAGEL folder in the published layout.

A BAGEL config here is a dict with `llm_config`, `vit_config`, `bagel` (the folder's `config.json`), `ae` (FLUX
autoencoder parameters) and `tokens` (bos / eos / start / end of image ids), as `presets.BAGEL_PRESETS`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omni.models.bagel.model import BagelArch, BagelMoT, sincos_2d
from megatron_omni.parallel.platform import megatron_config_defaults
from model_providers.ar_dit.decoder_mapping import DecoderMapping
from model_providers.ar_dit.decoder_provider import gather_mapped_tensors, load_mapped_tensors
from model_providers.bagel.mapping import FROZEN_PREFIXES, all_mappings
from model_providers.bagel.presets import bagel_preset
from model_providers.registry import SameNameLayout, WeightPart


def bagel_config(name_or_config: str | dict[str, Any]) -> dict[str, Any]:
    """A BAGEL config dict from a preset name or a dict; raises ValueError for options this model does not
    reproduce (rope scaling, sliding window, a non-SiLU activation, a layer module other than MoT)."""
    cfg = bagel_preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    missing = [k for k in ("llm_config", "bagel", "tokens") if k not in cfg]
    if missing:
        raise ValueError(f"BAGEL config lacks {missing}")
    llm = cfg["llm_config"]
    if llm.get("rope_scaling"):
        raise ValueError(f"BAGEL rope scaling is not supported: {llm['rope_scaling']}")
    if llm.get("use_sliding_window"):
        raise ValueError("BAGEL sliding-window attention is not supported")
    if llm.get("hidden_act", "silu") != "silu":
        raise ValueError(f"BAGEL hidden_act {llm.get('hidden_act')!r} is not supported (SwiGLU uses silu)")
    if llm.get("layer_module", "Qwen2MoTDecoderLayer") != "Qwen2MoTDecoderLayer":
        raise ValueError(f"only BAGEL's MoT layer is supported, not {llm['layer_module']!r}")
    return cfg


def arch(cfg: dict[str, Any]) -> BagelArch:
    """The `BagelArch` of a BAGEL config."""
    llm, b = cfg["llm_config"], cfg["bagel"]
    return BagelArch(vocab_size=llm["vocab_size"], rope_theta=float(llm["rope_theta"]),
                     patch_latent_dim=b["latent_patch_size"] ** 2 * b["vae_config"]["z_channels"],
                     max_latent_size=b["max_latent_size"], qk_norm=bool(llm.get("qk_norm", True)))


def transformer_config(name_or_config: str | dict[str, Any], *, tp: int = 1, pp: int = 1,
                       params_dtype: torch.dtype = torch.float32, **overrides: Any) -> TransformerConfig:
    """The Megatron `TransformerConfig` of BAGEL's language model for a parallel layout."""
    llm = bagel_config(name_or_config)["llm_config"]
    n, g = llm["num_attention_heads"], llm.get("num_key_value_heads", llm["num_attention_heads"])
    if g % tp:
        raise ValueError(f"{g} query groups are not divisible by tp={tp}")
    if llm["vocab_size"] % tp:
        raise ValueError(f"vocabulary {llm['vocab_size']} is not divisible by tp={tp}")
    kwargs: dict[str, Any] = dict(
        num_layers=llm["num_hidden_layers"], hidden_size=llm["hidden_size"], ffn_hidden_size=llm["intermediate_size"],
        num_attention_heads=n, num_query_groups=g, kv_channels=llm["hidden_size"] // n, normalization="RMSNorm",
        layernorm_epsilon=llm["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, rotary_interleaved=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        # Our MoT layers build their own QK norms; the flag makes Megatron's finalize_model_grads sum the
        # q/k_layernorm grads over tp (each tp rank's covers its own heads only, the weights are replicated).
        qk_layernorm=bool(llm.get("qk_norm", True)),
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        batch_p2p_comm=False,  # the pipeline schedule's p2p one op at a time (batched p2p on gloo gave wrong results)
    )
    kwargs.update(megatron_config_defaults())
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(name_or_config: str | dict[str, Any], groups, params_dtype: torch.dtype = torch.float32) -> BagelMoT:
    """This rank's `BagelMoT` stage (`groups`: `megatron_omni.parallel.ParallelGroups`; tp and pp are read from
    its layout, and a generation step splits its image tokens over `groups.cp`, ulysses x ring as one group: BAGEL's
    context parallelism is the k/v all-gather of `models.bagel.mot`, see docs/families-bagel.md)."""
    cfg = bagel_config(name_or_config)
    layout = groups.layout
    tcfg = transformer_config(cfg, tp=layout.tp, pp=layout.pp, params_dtype=params_dtype)
    return BagelMoT(tcfg, arch(cfg), groups)


def local_mappings(model: BagelMoT) -> dict[str, DecoderMapping]:
    """Local parameter name -> mapping, for the tensors this pipeline stage holds."""
    by_global = {m.megatron: m for m in all_mappings(model.config.num_layers, model.arch.qk_norm)}
    out = {}
    for name in model.state_dict():
        if name.endswith("_extra_state") or ".lora.lora_" in name:  # LoRA adapters are not BAGEL tensors
            continue
        glob = model.global_name(name)
        if glob not in by_global:
            raise KeyError(f"Megatron tensor {glob} has no BAGEL mapping")
        out[name] = by_global[glob]
    return out


def load_bagel_state(model: BagelMoT, state: dict[str, torch.Tensor]) -> None:
    """Copy BAGEL-named full tensors (`ema.safetensors` names) into this rank's shards (every rank passes the
    same dict; the frozen ViT tensors are not read)."""
    load_mapped_tensors(model, local_mappings(model), state, what="BAGEL")


def export_bagel_state(model: BagelMoT, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """BAGEL-named full tensors of this pipeline stage, gathered over tp (collective over tp). `tensors` defaults
    to the model's parameters (pass `{name: p.grad}` to map gradients)."""
    return gather_mapped_tensors(model, local_mappings(model), tensors)


def _rollout_layout(kind: str) -> SameNameLayout:
    """BAGEL's rollout layout: vLLM-Omni's BAGEL pipeline takes BAGEL-named full tensors through its own loader
    (`rollout.vllm_omni.bagel.BagelWeightTarget`), at rollout tp > 1 on every rank of the group, whose vLLM weight
    loaders keep the rank's shard."""
    if kind != "vllm_omni":
        raise KeyError(f"BAGEL has no {kind!r} rollout layout (its rollout is vLLM-Omni's BAGEL pipeline)")
    return SameNameLayout(kind="vllm_omni", max_tp=None)


def weight_parts(name_or_config: str | dict[str, Any]) -> dict[str, WeightPart]:
    """The one part the bridge syncs: every tensor of `BagelMoT` (both experts, the generation side, embeddings
    and head) into the rollout pipeline, under BAGEL's names."""
    cfg = bagel_config(name_or_config)
    llm = cfg["llm_config"]
    return {"bagel": WeightPart(all_mappings(llm["num_hidden_layers"], arch(cfg).qk_norm), megatron_shapes(cfg),
                                llm["num_attention_heads"], llm["num_hidden_layers"], _rollout_layout,
                                num_groups=llm["num_key_value_heads"])}


def megatron_sources(model: BagelMoT) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's tensors by global Megatron name (local tp shards of its stage, the parameters' storage)."""
    state = model.state_dict(keep_vars=True)
    return {"bagel": {m.megatron: state[name].detach() for name, m in local_mappings(model).items()}}


# ---------------------------------------------------------------------------------------------- the folder

def bagel_shapes(name_or_config: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every `ema.safetensors` tensor our Megatron model holds (BAGEL names), from the config."""
    cfg = bagel_config(name_or_config)
    a = arch(cfg)
    llm = cfg["llm_config"]
    h, ffn, n, g = llm["hidden_size"], llm["intermediate_size"], llm["num_attention_heads"], llm["num_key_value_heads"]
    d = h // n
    per_proj = {"q_proj": (n * d, h), "k_proj": (g * d, h), "v_proj": (g * d, h), "o_proj": (h, n * d),
                "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn), "q_norm": (d,), "k_norm": (d,)}
    shapes: dict[str, tuple[int, ...]] = {}
    for m in all_mappings(llm["num_hidden_layers"], a.qk_norm):
        for name in m.hf:
            if not name.startswith("language_model.model.layers."):
                continue
            leaf, kind = name.rsplit(".", 2)[-2:]
            base = leaf.replace("_moe_gen", "")
            shape = per_proj.get(base, (h,))  # the layer norms
            shapes[name] = shape[:1] if kind == "bias" else shape
    shapes.update({
        "language_model.model.embed_tokens.weight": (a.vocab_size, h),
        "language_model.lm_head.weight": (a.vocab_size, h),
        "language_model.model.norm.weight": (h,), "language_model.model.norm_moe_gen.weight": (h,),
        "time_embedder.mlp.0.weight": (h, a.timestep_freq_dim), "time_embedder.mlp.0.bias": (h,),
        "time_embedder.mlp.2.weight": (h, h), "time_embedder.mlp.2.bias": (h,),
        "vae2llm.weight": (h, a.patch_latent_dim), "vae2llm.bias": (h,),
        "llm2vae.weight": (a.patch_latent_dim, h), "llm2vae.bias": (a.patch_latent_dim,),
        "latent_pos_embed.pos_embed": (a.max_latent_size ** 2, h),
    })
    return shapes


def megatron_shapes(name_or_config: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every Megatron tensor of `BagelMoT`, from the config alone."""
    cfg = bagel_config(name_or_config)
    hf = bagel_shapes(cfg)
    out = {}
    for m in all_mappings(cfg["llm_config"]["num_hidden_layers"], arch(cfg).qk_norm):
        parts = [hf[n] for n in m.hf]
        out[m.megatron] = parts[0] if m.kind == "copy" else (sum(p[0] for p in parts), *parts[0][1:])
    return out


def random_bagel_state(name_or_config: str | dict[str, Any], seed: int = 0,
                       std: float = 0.1) -> dict[str, torch.Tensor]:
    """Seeded random BAGEL weights in `ema.safetensors` names (fp32): the language model of both experts, the
    generation side (the latent position table is BAGEL's fixed sin-cos table) and a frozen SigLIP ViT with its
    connector and position table. Norm weights around 1, projections N(0, std)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = bagel_config(name_or_config)
    h = cfg["llm_config"]["hidden_size"]
    shapes = {k: v for k, v in bagel_shapes(cfg).items() if k != "latent_pos_embed.pos_embed"}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(shapes.items()):
        if "norm" in name.rsplit(".", 2)[-2]:
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = std * torch.randn(shape, generator=gen)
    state["latent_pos_embed.pos_embed"] = sincos_2d(h, cfg["bagel"]["max_latent_size"])
    # The frozen understanding side: SigLIP (as vLLM-Omni builds it: no head), its connector and position table.
    torch.manual_seed(seed + 1)
    vit_cfg = {k: v for k, v in cfg["vit_config"].items() if k != "model_type"}
    vit = SiglipVisionModel(SiglipVisionConfig(**vit_cfg, vision_use_head=False))
    for k, v in vit.state_dict().items():
        if k.endswith("patch_embedding.weight"):
            v = v.flatten(1)  # BAGEL stores the patch embedding as a linear [hidden, C * P * P]
        state[f"vit_model.{k}"] = v.detach().clone()
    vh = cfg["vit_config"]["hidden_size"]
    state.update({"connector.fc1.weight": std * torch.randn(h, vh, generator=gen), "connector.fc1.bias": torch.zeros(h),
                  "connector.fc2.weight": std * torch.randn(h, h, generator=gen), "connector.fc2.bias": torch.zeros(h),
                  "vit_pos_embed.pos_embed": sincos_2d(h, cfg["bagel"]["vit_max_num_patch_per_side"])})
    return state


# The published `config.json`'s model identity: vLLM-Omni picks its BAGEL pipeline by it (`model_type` "bagel" or
# the architecture), as transformers-style loaders do.
PUBLISHED_IDENTITY = {"model_type": "bagel", "architectures": ["BagelForConditionalGeneration"]}


def write_bagel_folder(folder: str | Path, name_or_config: str | dict[str, Any], seed: int = 0) -> Path:
    """Write an offline BAGEL folder in the published layout: `config.json`, `llm_config.json`,
    `vit_config.json`, `ema.safetensors` (seeded random weights, `random_bagel_state`), `ae.safetensors`
    (a FLUX-layout autoencoder of the config's `ae` parameters, seeded) and, when the config's special token ids
    are the tiny tokenizer's, that tokenizer's files (`tokenizer.json`, `tokenizer_config.json`, as the published
    folder ships Qwen2's). Written to a temp folder, then renamed."""
    from safetensors.torch import save_file

    cfg = bagel_config(name_or_config)
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    tmp = Path(tempfile.mkdtemp(prefix=".bagel-", dir=folder.parent if folder.parent.exists() else None))
    try:
        top = dict(PUBLISHED_IDENTITY, **cfg["bagel"], new_token_ids=cfg["tokens"],
                   vit_config={k: cfg["vit_config"][k] for k in ("hidden_size", "patch_size")})
        (tmp / "config.json").write_text(json.dumps(top, indent=2))
        (tmp / "llm_config.json").write_text(json.dumps(cfg["llm_config"], indent=2))
        (tmp / "vit_config.json").write_text(json.dumps(cfg["vit_config"], indent=2))
        save_file({k: v.contiguous() for k, v in random_bagel_state(cfg, seed).items()}, str(tmp / "ema.safetensors"))
        save_file(_flux_autoencoder_state(cfg["ae"], seed), str(tmp / "ae.safetensors"))
        tiny_ids = dict(zip(("bos_token_id", "eos_token_id", "start_of_image", "end_of_image"), range(1, 5)))
        if cfg["tokens"] == tiny_ids and cfg["llm_config"]["vocab_size"] >= 100:
            from model_providers.bagel.tokenizer import build_tiny_tokenizer

            build_tiny_tokenizer().save_pretrained(str(tmp))
        if folder.exists():
            folder.rmdir()
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _flux_autoencoder_state(ae: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """A seeded FLUX autoencoder's tensors (`encoder.*` / `decoder.*`, the names BAGEL's `ae.safetensors` uses),
    built by vLLM-Omni's own FLUX `AutoEncoder`."""
    from vllm_omni.diffusion.models.bagel.autoencoder import AutoEncoder, AutoEncoderParams

    torch.manual_seed(seed + 2)
    return {k: v.contiguous() for k, v in AutoEncoder(AutoEncoderParams(**ae)).state_dict().items()}


def read_bagel_folder(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(BAGEL config, `ema.safetensors` tensors) of a BAGEL folder in the published layout."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "ema.safetensors").exists():
        raise FileNotFoundError(f"{folder} is not a BAGEL folder: ema.safetensors is missing")
    return read_bagel_config(folder), load_file(str(folder / "ema.safetensors"))


def read_bagel_config(folder: str | Path) -> dict[str, Any]:
    """The BAGEL config of a folder in the published layout (its three JSON files; no weights read)."""
    folder = Path(folder)
    for f in ("config.json", "llm_config.json", "vit_config.json"):
        if not (folder / f).exists():
            raise FileNotFoundError(f"{folder} is not a BAGEL folder: {f} is missing")
    bagel = json.loads((folder / "config.json").read_text())
    for key in PUBLISHED_IDENTITY:  # what names the model to loaders (vLLM-Omni's), not part of its geometry
        bagel.pop(key, None)
    tokens = bagel.pop("new_token_ids", None)
    if tokens is None:
        raise ValueError(f"{folder}/config.json lacks new_token_ids (bos/eos/start/end of image token ids)")
    cfg = dict(llm_config=json.loads((folder / "llm_config.json").read_text()),
               vit_config=json.loads((folder / "vit_config.json").read_text()), bagel=bagel, tokens=tokens)
    return bagel_config(cfg)


def frozen_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The tensors of a BAGEL state our Megatron model does not hold (the ViT side)."""
    return [k for k in state if k.startswith(FROZEN_PREFIXES)]
