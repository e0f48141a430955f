"""BAGEL's Mixture-of-Transformers in the planner (a pure cost model): per-rank parameters of both experts, the
trainable share that carries gradients and Adam state (the generation expert alone when the understanding expert is
frozen), and the FLOPs of one generation step.

Counts follow how `megatron_omni.models.bagel` builds each tensor (`model_providers.bagel.mapping` gives the
tensor-parallel dim and the pipeline stage of each); the distributed parity test checks them against the built
model's parameter counts per rank. Memory here is weights, gradients and optimizer state only (no activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_providers.bagel.mapping import all_mappings
from model_providers.bagel.provider import arch, bagel_config, megatron_shapes

GIB = 1024**3
# Tensors of the generation side that train with the generation expert (the latent position table is fixed).
_GEN_MODULES = ("time_embedder.", "vae2llm.", "llm2vae.", "decoder.final_layernorm_gen.")


def is_generation_tensor(name: str) -> bool:
    """Whether Megatron tensor `name` belongs to the generation expert (or the generation-side modules)."""
    return name.startswith(_GEN_MODULES) or (name.startswith("decoder.layers.") and "_gen." in name)


def rank_parameter_counts(model: str | dict[str, Any], tp: int, pp: int = 1, trainable: str | None = None
                          ) -> list[int]:
    """Parameters one tensor-parallel rank of each pipeline stage holds ([pp] counts).

    `trainable`: None counts every parameter; "gen" only the generation expert's; "both" every trainable one
    (all but the fixed latent position table)."""
    cfg = bagel_config(model)
    shapes = megatron_shapes(cfg)
    n_layers = cfg["llm_config"]["num_hidden_layers"]
    if n_layers % pp:
        raise ValueError(f"{n_layers} BAGEL layers are not divisible by pp={pp}")
    per_stage = n_layers // pp
    out = [0] * pp
    for m in all_mappings(n_layers, arch(cfg).qk_norm):
        if trainable == "gen" and not is_generation_tensor(m.megatron):
            continue
        if trainable is not None and m.megatron == "latent_pos_embed":
            continue
        numel = 1
        for s in shapes[m.megatron]:
            numel *= s
        if m.tp_dim is not None:
            numel //= tp
        stage = 0 if m.stage == "pre" else pp - 1 if m.stage == "post" else m.layer // per_stage
        out[stage] += numel
    return out


@dataclass(frozen=True)
class MoTMemory:
    """Per-GPU bytes of the most loaded pipeline stage: weights, gradients and Adam state (fp32 master + 2 moments
    for bf16 weights, 2 moments for fp32 weights) of the trainable share."""

    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer

    def gib(self) -> str:
        return (f"weights {self.weights / GIB:.1f} GiB + grads {self.grads / GIB:.1f} GiB + optimizer "
                f"{self.optimizer / GIB:.1f} GiB = {self.total / GIB:.1f} GiB")


def mot_memory(model: str | dict[str, Any], tp: int, pp: int = 1, train: str = "gen", bf16: bool = True,
               dp: int = 1, distributed_optimizer: bool = False) -> MoTMemory:
    """Weights of both experts, gradients and optimizer state of the trained share (`train`: "gen" | "both"), on
    the most loaded stage; a distributed optimizer divides the optimizer state over `dp`."""
    if train not in ("gen", "both"):
        raise ValueError(f"train must be 'gen' or 'both', not {train!r}")
    params = rank_parameter_counts(model, tp, pp)
    trained = rank_parameter_counts(model, tp, pp, trainable=train)
    i = max(range(pp), key=lambda s: params[s] * (2 if bf16 else 4) + trained[s] * 16)
    width = 2 if bf16 else 4
    opt = trained[i] * (12 if bf16 else 8)
    return MoTMemory(weights=params[i] * width, grads=trained[i] * 4,
                     optimizer=opt // dp if distributed_optimizer else opt)


def generation_step_flops(model: str | dict[str, Any], image_tokens: int, prompt_tokens: int) -> int:
    """Forward FLOPs of one generation step (one CFG branch): the image tokens through the generation expert's
    linears, the 2 image markers through the understanding expert's, non-causal attention of the image query over
    [prompt KV, image query], and the LM-free projections in and out (prompt KV assumed cached)."""
    cfg = bagel_config(model)
    llm = cfg["llm_config"]
    h, ffn, n_layers = llm["hidden_size"], llm["intermediate_size"], llm["num_hidden_layers"]
    heads, groups = llm["num_attention_heads"], llm["num_key_value_heads"]
    d = h // heads
    linear = h * (heads + 2 * groups) * d + heads * d * h + 3 * h * ffn  # qkv, o, gate/up/down per token
    q = image_tokens + 2
    attn = 2 * 2 * q * (prompt_tokens + q) * heads * d  # QK^T and AV
    p = arch(cfg).patch_latent_dim
    io = 2 * image_tokens * (2 * p * h) + 2 * image_tokens * (256 * h + h * h)  # vae2llm, llm2vae, time embedder
    return n_layers * (2 * q * linear + attn) + io
