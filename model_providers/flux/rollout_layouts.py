"""Where each diffusers-named FLUX.1 tensor lives in a rollout engine's parameters, declared as data for the bridge
planner (the rule kinds are Qwen-Image's; the helpers SD3.5's).

vLLM-Omni 0.30.0 (`vllm_omni/diffusion/models/flux/flux_transformer.py`, `FluxTransformer2DModel`):
- double-stream blocks (`transformer_blocks.{i}`): `attn.to_qkv` / `attn.add_kv_proj` are `QKVParallelLinear`s
  fusing diffusers' `attn.to_q/k/v` / `attn.add_q/k/v_proj`; `attn.to_out.0`, `attn.to_add_out` and the MLPs'
  `net.2` row-parallel with a whole bias; the MLPs' `net.0.proj` column-parallel; the adaLN linears
  (`norm1.linear`, `norm1_context.linear`) and the QK RMSNorms replicated;
- single-stream blocks (`single_transformer_blocks.{i}`): `attn.to_qkv` fuses `attn.to_q/k/v` (its output is
  gathered over tp before the replicated `proj_out`); `norm.linear`, `proj_mlp`, `proj_out` and the QK RMSNorms are
  replicated;
- every non-block layer (time / guidance / text embedders, `context_embedder`, `x_embedder`, `norm_out`,
  `proj_out`) is replicated.
Its `load_weights` takes unprefixed diffusers names (our pipeline class strips `transformer.`).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_providers.qwen_image.rollout_layouts import RolloutLayout
from model_providers.registry import RolloutRule, SameNameLayout
from model_providers.sd3.rollout_layouts import mlp_rules, qkv_rules, replicated, row_rules

ROLLOUT_KINDS = ("vllm_omni", "diffusers")

_NON_BLOCK = tuple(f"{m}.{k}" for m in (
    "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2", "context_embedder",
    "x_embedder", "norm_out.linear", "proj_out") for k in ("weight", "bias"))
_QK_NORMS = ("attn.norm_q.weight", "attn.norm_k.weight")

# The linears vLLM-Omni 0.30.0's FLUX module builds with the engine's quantization config, as diffusers module names
# (`rollout.quantization`; the embedded engine's fake FP8 quantizes the same ones): the single-stream blocks'
# `attn.to_q/k/v` (fused there as `to_qkv`), `proj_mlp` and `proj_out`. Its `FluxTransformer2DModel` hands the
# double-stream blocks `safe_quant_config(quant_config)` (none for FP8: the config meant for norm / modulation
# layers, vllm-omni #2728), so every double-stream linear stays in full precision, as do the single blocks' adaLN
# (`norm.linear`) and every non-block layer (measured: 3 FP8 layers per single block, none in a double block).
QUANTIZED_LINEARS = tuple(f"single_transformer_blocks.*.{m}" for m in (
    "attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"))


def _double_rules() -> tuple[RolloutRule, ...]:
    rules = qkv_rules("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v"))
    rules += qkv_rules("attn.add_kv_proj", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))
    rules += row_rules("attn.to_out.0") + row_rules("attn.to_add_out") + mlp_rules("ff") + mlp_rules("ff_context")
    rules += replicated(*_QK_NORMS, "attn.norm_added_q.weight", "attn.norm_added_k.weight")
    rules += replicated(*(f"{n}.linear.{k}" for n in ("norm1", "norm1_context") for k in ("weight", "bias")))
    return tuple(rules)


def _single_rules() -> tuple[RolloutRule, ...]:
    rules = qkv_rules("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")) + replicated(*_QK_NORMS)
    rules += replicated(*(f"{m}.{k}" for m in ("norm.linear", "proj_mlp", "proj_out") for k in ("weight", "bias")))
    return tuple(rules)


@dataclass(frozen=True)
class TwoBlockLayout:
    """A rollout layout over two block lists (FLUX's double- then single-stream blocks): a tensor's rule is the
    single blocks' layout's for `single_transformer_blocks.{i}.` names, the double blocks' (with the non-block
    rules) otherwise."""

    kind: str
    double: RolloutLayout
    single: RolloutLayout
    load_prefix: str = "transformer."
    max_tp: int | None = None

    def rule(self, hf_name: str) -> tuple[str, RolloutRule]:
        """(rollout parameter name, rule) of a diffusers tensor name; KeyError naming it if unknown."""
        layout = self.single if hf_name.startswith(f"{self.single.block_prefix}.") else self.double
        return layout.rule(hf_name)


def rollout_layout(kind: str) -> TwoBlockLayout | SameNameLayout:
    """The layout of rollout engine `kind`: 'vllm_omni' (vLLM-Omni 0.30.0's FLUX module, any tp whose divisions are
    exact), 'diffusers' (diffusers' own module: every tensor whole, under its own name)."""
    if kind == "vllm_omni":
        double = RolloutLayout(kind, _double_rules(), tuple(replicated(*_NON_BLOCK)), "transformer.", None)
        single = RolloutLayout(kind, _single_rules(), (), "transformer.", None,
                               block_prefix="single_transformer_blocks")
        return TwoBlockLayout(kind, double, single)
    if kind == "diffusers":
        return SameNameLayout()
    raise KeyError(f"the flux family has no rollout layout for engine {kind!r}; known: {list(ROLLOUT_KINDS)}")
