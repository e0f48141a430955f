"""Where each diffusers-named SD3.5 tensor lives in a rollout engine's parameters, declared as data for the bridge
planner (the rule kinds are Qwen-Image's: replicated, column, row, qkv; see its rollout_layouts).

vLLM-Omni 0.30.0 (`vllm_omni/diffusion/models/sd3/sd3_transformer.py`, `SD3Transformer2DModel`):
- `attn.to_qkv` and `attn.add_kv_proj` are `QKVParallelLinear`s fusing diffusers' `attn.to_q/k/v` and
  `attn.add_q/k/v_proj` (rank r holds `[Q_r; K_r; V_r]`); so is a dual-attention block's `attn2.to_qkv`;
- `attn.to_out.0`, `attn.to_add_out`, `attn2.to_out.0` and the MLPs' `net.2` are row-parallel with a whole bias; the
  MLPs' `net.0.proj` column-parallel;
- the QK RMSNorms (one weight per head dim), the adaLN linears (`norm1.linear`, `norm1_context.linear`: diffusers'
  modules) and every non-block layer (patch embedding, time/text embedder, context embedder, `norm_out`, `proj_out`)
  are replicated; the sincos position table (`pos_embed.pos_embed`, a buffer both sides compute) is not synced.
Its `load_weights` takes unprefixed diffusers names (our pipeline class strips `transformer.`) and reports the fused
parameter for a q/k/v tensor (our class reports the diffusers name too).
"""

from __future__ import annotations

from model_providers.qwen_image.rollout_layouts import RolloutLayout
from model_providers.registry import RolloutRule, SameNameLayout

ROLLOUT_KINDS = ("vllm_omni", "diffusers")

# The linears an FP8 rollout quantizes (`rollout.quantization`), as diffusers module names: the blocks' attention
# projections (fused in vLLM-Omni as `to_qkv` / `add_kv_proj`) and both MLPs, the set FLUX.1's vLLM-Omni module
# quantizes less what SD3.5 builds otherwise. vLLM-Omni 0.30.0's SD3 module passes its quantization config to no
# linear, so our pipeline class rebuilds these with it (`rollout/vllm_omni/fp8.quantize_linears`). Full precision:
# the adaLN linears (diffusers' `nn.Linear`s in vLLM-Omni, which take no vLLM quantization method), every non-block
# layer, and a dual-attention block's `attn2` (SD3.5 Large has none: a pattern that matches no linear is refused by
# the fake quantizer of the embedded engine).
QUANTIZED_LINEARS = tuple(f"transformer_blocks.*.{m}" for m in (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0",
    "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"))

_NON_BLOCK = tuple(f"{m}.{k}" for m in (
    "pos_embed.proj", "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2", "context_embedder",
    "norm_out.linear", "proj_out") for k in ("weight", "bias"))


def qkv_rules(fused: str, parts: tuple[str, str, str]) -> list[RolloutRule]:
    """Rules of three diffusers projections (weight and bias) fused into one `QKVParallelLinear` `fused`."""
    return [RolloutRule(f"{p}.{k}", f"{fused}.{k}", "qkv", i) for i, p in enumerate(parts) for k in ("weight", "bias")]


def mlp_rules(mlp: str) -> list[RolloutRule]:
    """Rules of a diffusers GELU `FeedForward` at `mlp` (`net.0.proj` column-parallel, `net.2` row-parallel)."""
    return [RolloutRule(f"{mlp}.net.0.proj.{k}", f"{mlp}.net.0.proj.{k}", "column") for k in ("weight", "bias")] + \
        row_rules(f"{mlp}.net.2")


def row_rules(linear: str, param: str | None = None) -> list[RolloutRule]:
    """A row-parallel linear: its weight split by columns, its bias whole on every rank."""
    param = param or linear
    return [RolloutRule(f"{linear}.weight", f"{param}.weight", "row"),
            RolloutRule(f"{linear}.bias", f"{param}.bias", "replicated")]


def replicated(*names: str) -> list[RolloutRule]:
    """Same-named tensors every rank holds whole."""
    return [RolloutRule(n, n, "replicated") for n in names]


def _vllm_block_rules() -> tuple[RolloutRule, ...]:
    rules = qkv_rules("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v"))
    rules += qkv_rules("attn.add_kv_proj", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))
    rules += qkv_rules("attn2.to_qkv", ("attn2.to_q", "attn2.to_k", "attn2.to_v"))
    for linear in ("attn.to_out.0", "attn.to_add_out", "attn2.to_out.0"):
        rules += row_rules(linear)
    rules += mlp_rules("ff") + mlp_rules("ff_context")
    rules += replicated(*(f"{a}.{n}.weight" for a, n in (("attn", "norm_q"), ("attn", "norm_k"),
                                                          ("attn", "norm_added_q"), ("attn", "norm_added_k"),
                                                          ("attn2", "norm_q"), ("attn2", "norm_k"))))
    rules += replicated(*(f"{n}.linear.{k}" for n in ("norm1", "norm1_context") for k in ("weight", "bias")))
    return tuple(rules)


def rollout_layout(kind: str) -> RolloutLayout | SameNameLayout:
    """The layout of rollout engine `kind`: 'vllm_omni' (vLLM-Omni 0.30.0's SD3 module, any tp whose divisions are
    exact), 'diffusers' (diffusers' own module: every tensor whole, under its own name)."""
    if kind == "vllm_omni":
        return RolloutLayout(kind, _vllm_block_rules(), tuple(replicated(*_NON_BLOCK)), "transformer.", None)
    if kind == "diffusers":
        return SameNameLayout()
    raise KeyError(f"the sd3 family has no rollout layout for engine {kind!r}; known: {list(ROLLOUT_KINDS)}")
