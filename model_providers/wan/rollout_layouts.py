"""Where each diffusers-named Wan tensor lives in a rollout engine's parameters, declared as data for the bridge
planner (the rule kinds are Qwen-Image's: replicated, column, row, qkv; see its rollout_layouts).

vLLM-Omni 0.30.0 (`vllm_omni/diffusion/models/wan2_2/wan2_2_transformer.py`, `WanTransformer3DModel`):
- self-attention `attn1.to_qkv` is a `QKVParallelLinear` fusing `attn1.to_q/k/v` (rank r holds
  `[Q_r; K_r; V_r]`); cross-attention `attn2.to_q`, `attn2.to_k`, `attn2.to_v` stay apart, column-parallel;
- `attn1.norm_q/k`, `attn2.norm_q/k` (`DistributedRMSNorm` at tp > 1) hold their heads' slice of the weight:
  column; `load_weights` slices the full tensor itself;
- `to_out` (diffusers `to_out.0`) and `ffn.net_2` (diffusers `ffn.net.2`) are row-parallel with a whole bias;
  `ffn.net_0.proj` (diffusers `ffn.net.0.proj`) column-parallel;
- the block's `scale_shift_table` and `norm2`, the patch embedding (a `Conv3dLayer`), the condition embedder,
  `proj_out` are replicated; the model's own `scale_shift_table` lives at `output_scale_shift_prepare.`.
The pipeline's `load_weights` (`Wan22Pipeline`, vLLM's `AutoWeightsLoader`) takes diffusers names prefixed
`transformer.` and hands them, unprefixed, to the transformer's `load_weights`, which logs and skips unknown
names: a sync is checked by its coverage and a probe forward.
"""

from __future__ import annotations

from model_providers.qwen_image.rollout_layouts import RolloutLayout
from model_providers.registry import RolloutRule

ROLLOUT_KINDS = ("vllm_omni", "diffusers")

_NON_BLOCK = {
    "patch_embedding.weight": "patch_embedding.weight",
    "patch_embedding.bias": "patch_embedding.bias",
    "scale_shift_table": "output_scale_shift_prepare.scale_shift_table",
    "proj_out.weight": "proj_out.weight",
    "proj_out.bias": "proj_out.bias",
    **{f"condition_embedder.{m}.{k}": f"condition_embedder.{m}.{k}"
       for m in ("time_embedder.linear_1", "time_embedder.linear_2", "time_proj", "text_embedder.linear_1",
                 "text_embedder.linear_2")
       for k in ("weight", "bias")},
}


def _vllm_block_rules() -> tuple[RolloutRule, ...]:
    rules = [RolloutRule(f"attn1.to_{p}.{k}", f"attn1.to_qkv.{k}", "qkv", i)
             for i, p in enumerate("qkv") for k in ("weight", "bias")]
    rules += [RolloutRule(f"attn2.to_{p}.{k}", f"attn2.to_{p}.{k}", "column")
              for p in "qkv" for k in ("weight", "bias")]
    rules += [RolloutRule(f"{a}.{n}.weight", f"{a}.{n}.weight", "column") for a in ("attn1", "attn2")
              for n in ("norm_q", "norm_k")]
    for hf, param in (("attn1.to_out.0", "attn1.to_out"), ("attn2.to_out.0", "attn2.to_out"),
                      ("ffn.net.2", "ffn.net_2")):
        rules.append(RolloutRule(f"{hf}.weight", f"{param}.weight", "row"))
        rules.append(RolloutRule(f"{hf}.bias", f"{param}.bias", "replicated"))
    rules += [RolloutRule(f"ffn.net.0.proj.{k}", f"ffn.net_0.proj.{k}", "column") for k in ("weight", "bias")]
    rules += [RolloutRule(n, n, "replicated") for n in ("scale_shift_table", "norm2.weight", "norm2.bias")]
    return tuple(rules)


def _diffusers_block_rules() -> tuple[RolloutRule, ...]:
    # diffusers' module is not tensor-parallel: every tensor is one parameter of its own name.
    return tuple(RolloutRule(r.hf, r.hf, "replicated") for r in _vllm_block_rules())


def rollout_layout(kind: str) -> RolloutLayout:
    """The layout of rollout engine `kind` ('vllm_omni' for vLLM-Omni 0.30.0's Wan2.2 module, 'diffusers')."""
    if kind == "vllm_omni":
        non_block = tuple(RolloutRule(hf, param, "replicated") for hf, param in _NON_BLOCK.items())
        return RolloutLayout(kind, _vllm_block_rules(), non_block, "transformer.", None, block_prefix="blocks")
    if kind == "diffusers":
        non_block = tuple(RolloutRule(hf, hf, "replicated") for hf in _NON_BLOCK)
        return RolloutLayout(kind, _diffusers_block_rules(), non_block, "", 1, block_prefix="blocks")
    raise KeyError(f"unknown rollout kind {kind!r}; known: {list(ROLLOUT_KINDS)}")
