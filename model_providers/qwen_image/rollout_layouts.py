"""Where each diffusers-named Qwen-Image tensor lives in a rollout engine's parameters, declared as data.

The bridge planner reads these tables. A rule maps one diffusers tensor (a suffix inside
`transformer_blocks.{i}.`, or a whole non-block name) to one rollout parameter and says how the rollout's
tensor parallelism splits it:

- `replicated`: every rollout rank holds the whole tensor;
- `column`: rows split over rollout ranks (dim 0);
- `row`: columns split (dim 1; row-parallel weights);
- `qkv`: a vLLM `QKVParallelLinear` part (`part` 0/1/2 = q/k/v): rollout rank r holds rows
  `[Q_r; K_r; V_r]`, each the heads `[r*n/R, (r+1)*n/R)` of that part.

vLLM-Omni 0.30.0 (`vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py`): `attn.to_qkv` and
`attn.add_kv_proj` are `QKVParallelLinear`; `attn.to_out` (diffusers `to_out.0`) and `attn.to_add_out` are
`RowParallelLinear` whose bias is whole on every rank; the MLPs are column (`net.0.proj`) then row
(`net.2`); adaLN (`img_mod.1`, `txt_mod.1`), QK norms and every non-block layer are replicated.
`load_weights` takes full diffusers names with the prefix `transformer.`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from model_providers.registry import RolloutRule

ROLLOUT_KINDS = ("vllm_omni", "diffusers")


def _vllm_block_rules() -> tuple[RolloutRule, ...]:
    rules: list[RolloutRule] = []
    for fused, parts in (("attn.to_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                         ("attn.add_kv_proj", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))):
        for i, p in enumerate(parts):
            for kind in ("weight", "bias"):
                rules.append(RolloutRule(f"{p}.{kind}", f"{fused}.{kind}", "qkv", i))
    for hf, param in (("attn.to_out.0", "attn.to_out"), ("attn.to_add_out", "attn.to_add_out"),
                      ("img_mlp.net.2", "img_mlp.net.2"), ("txt_mlp.net.2", "txt_mlp.net.2")):
        rules.append(RolloutRule(f"{hf}.weight", f"{param}.weight", "row"))
        rules.append(RolloutRule(f"{hf}.bias", f"{param}.bias", "replicated"))
    for hf in ("img_mlp.net.0.proj", "txt_mlp.net.0.proj"):
        for kind in ("weight", "bias"):
            rules.append(RolloutRule(f"{hf}.{kind}", f"{hf}.{kind}", "column"))
    for hf in ("img_mod.1.weight", "img_mod.1.bias", "txt_mod.1.weight", "txt_mod.1.bias", "attn.norm_q.weight",
               "attn.norm_k.weight", "attn.norm_added_q.weight", "attn.norm_added_k.weight"):
        rules.append(RolloutRule(hf, hf, "replicated"))
    return tuple(rules)


def _diffusers_block_rules() -> tuple[RolloutRule, ...]:
    # diffusers' module is not tensor-parallel: every tensor is one parameter of the same name.
    return tuple(RolloutRule(r.hf, r.hf, "replicated") for r in _vllm_block_rules())


# The linears vLLM-Omni 0.30.0 builds with the engine's quantization config, as diffusers module names: every
# block's attention projections (fused there as `to_qkv` / `add_kv_proj`) and MLPs. The adaLN modulations
# (`img_mod.1`, `txt_mod.1`), the timestep embedder, `img_in`, `txt_in`, `norm_out.linear` and `proj_out` stay in
# full precision there (its `quant_config=None` / `safe_quant_config`, vllm-omni #2728), so they do here too.
QUANTIZED_LINEARS = tuple(f"transformer_blocks.*.{m}" for m in (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0",
    "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"))

_NON_BLOCK_NAMES = (
    "time_text_embed.timestep_embedder.linear_1.weight", "time_text_embed.timestep_embedder.linear_1.bias",
    "time_text_embed.timestep_embedder.linear_2.weight", "time_text_embed.timestep_embedder.linear_2.bias",
    "img_in.weight", "img_in.bias", "txt_norm.weight", "txt_in.weight", "txt_in.bias",
    "norm_out.linear.weight", "norm_out.linear.bias", "proj_out.weight", "proj_out.bias",
)

@dataclass(frozen=True)
class RolloutLayout:
    """A rollout engine's parameter layout of a DiT (see the module docstring): rules for the tensors inside
    `{block_prefix}.{i}.` (block-relative names) and for the rest (whole names)."""

    kind: str
    block_rules: tuple[RolloutRule, ...]
    non_block_rules: tuple[RolloutRule, ...]
    load_prefix: str  # what the engine's `load_weights` expects before diffusers names
    max_tp: int | None  # None: any tensor-parallel size whose divisions are exact
    block_prefix: str = "transformer_blocks"

    def rule(self, hf_name: str) -> tuple[str, RolloutRule]:
        """(rollout parameter name, rule) of a diffusers tensor name; KeyError naming it if unknown."""
        m = re.match(rf"^{re.escape(self.block_prefix)}\.(\d+)\.(.+)$", hf_name)
        if m:
            idx, rest = m.groups()
            for r in self.block_rules:
                if r.hf == rest:
                    return f"{self.block_prefix}.{idx}.{r.param}", r
        else:
            for r in self.non_block_rules:
                if r.hf == hf_name:
                    return r.param, r
        raise KeyError(f"{self.kind} rollout layout has no rule for diffusers tensor {hf_name!r}")


def rollout_layout(kind: str) -> RolloutLayout:
    """The layout of rollout engine `kind` ('vllm_omni' for vLLM-Omni 0.30.0, 'diffusers')."""
    non_block = tuple(RolloutRule(n, n, "replicated") for n in _NON_BLOCK_NAMES)
    if kind == "vllm_omni":
        return RolloutLayout(kind, _vllm_block_rules(), non_block, "transformer.", None)
    if kind == "diffusers":
        return RolloutLayout(kind, _diffusers_block_rules(), non_block, "", 1)
    raise KeyError(f"unknown rollout kind {kind!r}; known: {list(ROLLOUT_KINDS)}")
