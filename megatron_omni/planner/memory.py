"""Per-GPU memory of a FlowGRPO job (part of the dry-run planner): parameters, gradients, optimizer states,
activations, rollout-engine weights.

Parameter counts are derived here from how `megatron_omni/models/dit/layer.py` builds each linear (adaLN,
QKV and fc1 column-parallel: rows split over tp; the output projection and fc2 row-parallel: weight
columns split, bias replicated; QK norms replicated) and from which pipeline stage owns which layer (the
timestep embedder on every stage, the input projections on the first, the output ones on the last). A
unit test checks them against the provider's exact per-rank counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from model_providers.qwen_image.provider import hf_config, megatron_shapes

_COLUMN = ("adaln.", "linear_qkv.", "linear_fc1.")
_ROW_WEIGHTS = ("linear_proj.weight", "linear_fc2.weight")
_EVERY_STAGE = ("time_embedder.",)
_FIRST_STAGE = ("img_in.", "txt_norm.", "txt_in.")
_LAST_STAGE = ("norm_out.", "proj_out.")

GIB = 1024**3

# Elements saved for the backward pass per token per stream of one block, as `(full, tp_split)` multiples
# of the hidden size h; the per-rank count is `full * h + tp_split * h / tp`. Measured on our block with
# saved-tensor hooks (tests/unit/test_planner.py measures it again at tp=1 and tp=2):
#   full (8): LN1 input, LN1 output (for d/d scale), modulated QKV input, attention-projection output
#         (for d/d gate1), LN2 input, LN2 output, modulated fc1 input, fc2 output (for d/d gate2);
#   split, no recompute (17): raw QKV 3, the joint [text; image] Q, K, V and output that attention keeps 4,
#         the QK-norm / RoPE intermediates and the per-stream attention output 2, fc1 output 4, GELU output 4.
# Selective recompute checkpoints the attention function (QKV projection, QK norm, RoPE, attention), so
# only its per-stream output stays: split 17 -> 9. Full recompute keeps each block's two input streams
# (1 x h per token) plus, while one block is recomputed, that block's full set.
_SAVED_PER_TOKEN = {"none": (8, 17), "selective": (8, 9)}
RECOMPUTE_MODES = ("none", "selective", "full")


def rank_parameter_counts(model: str | dict[str, Any], tp: int, pp: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage at tensor-parallel size `tp` (index = stage)."""
    cfg = hf_config(model)
    layers, heads = cfg["num_layers"], cfg["num_attention_heads"]
    if layers % pp:
        raise ValueError(f"{layers} blocks are not divisible by pp={pp}")
    if heads % tp:
        raise ValueError(f"{heads} heads are not divisible by tp={tp}")
    per_stage = layers // pp
    counts = [0] * pp
    for name, shape in megatron_shapes(cfg).items():
        n = math.prod(shape)
        if name.startswith("layers."):
            layer, tensor = int(name.split(".")[1]), name.split(".", 3)[3]
            if tensor.startswith(_COLUMN) or tensor in _ROW_WEIGHTS:
                dim = 1 if tensor in _ROW_WEIGHTS else 0
                if shape[dim] % tp:
                    raise ValueError(f"{name} {shape}: dim {dim} is not divisible by tp={tp}")
                n //= tp
            counts[layer // per_stage] += n
        elif name.startswith(_EVERY_STAGE):
            for s in range(pp):
                counts[s] += n
        elif name.startswith(_FIRST_STAGE):
            counts[0] += n
        elif name.startswith(_LAST_STAGE):
            counts[-1] += n
        else:
            raise ValueError(f"planner memory model does not know which stage holds {name}")
    return counts


def rollout_parameter_count(model: str | dict[str, Any], rollout_tp: int) -> int:
    """Transformer parameters on one GPU of a vLLM-Omni rollout engine at tensor-parallel size `rollout_tp`.

    vLLM-Omni splits the attention projections and the MLPs; adaLN, the QK norms, the row-parallel
    biases and all non-block layers are replicated (docs/design.md section 4), so adaLN's third of the model
    is on every rollout GPU.
    """
    cfg = hf_config(model)
    if cfg["num_attention_heads"] % rollout_tp:
        raise ValueError(f"{cfg['num_attention_heads']} heads are not divisible by rollout tp={rollout_tp}")
    total = 0
    for name, shape in megatron_shapes(cfg).items():
        n = math.prod(shape)
        tensor = name.split(".", 3)[3] if name.startswith("layers.") else ""
        if tensor.startswith(("linear_qkv.", "linear_fc1.")) or tensor in _ROW_WEIGHTS:
            n //= rollout_tp
        total += n
    return total


def block_activation_bytes(
    hidden: int, tokens: int, samples: int, tp: int, recompute: str, act_bytes: int = 2
) -> int:
    """Bytes one block keeps for its backward pass: `tokens` per sample on this rank (image shard + text),
    `samples` samples, under `recompute` ('none' | 'selective' | 'full'; full keeps only the inputs)."""
    if recompute == "full":
        return act_bytes * tokens * samples * hidden
    if recompute not in _SAVED_PER_TOKEN:
        raise ValueError(f"unknown recompute mode {recompute!r}; known: {RECOMPUTE_MODES}")
    full, split = _SAVED_PER_TOKEN[recompute]
    return act_bytes * tokens * samples * (full * hidden + split * hidden // tp)


def training_activation_bytes(
    model: str | dict[str, Any], *, tokens_per_rank: int, micro_batch_samples: int, tp: int, pp: int,
    in_flight: int, recompute: str, act_bytes: int = 2,
) -> int:
    """Peak activation bytes on the first pipeline stage (the fullest under 1F1B).

    tokens_per_rank: image tokens / cp + text tokens; micro_batch_samples: samples in one micro-batch
    (CFG doubles them); in_flight: micro-batches whose activations the stage holds at once
    (min(pp, micro-batches) under 1F1B, 1 without pipelining).
    """
    cfg = hf_config(model)
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    blocks = cfg["num_layers"] // pp
    per_block = block_activation_bytes(hidden, tokens_per_rank, micro_batch_samples, tp, recompute, act_bytes)
    held = blocks * in_flight * per_block
    if recompute == "full":  # the block being recomputed holds its full set once
        held += block_activation_bytes(hidden, tokens_per_rank, micro_batch_samples, tp, "none", act_bytes)
    return held


def rollout_activation_bytes(
    model: str | dict[str, Any], *, tokens: int, batch: int, rollout_tp: int, act_bytes: int = 2
) -> int:
    """Working set of one inference forward (no grad): the live tensors of one block at its widest point
    (residual, modulated input, gated branch: 3 x h; fc1 and GELU outputs: 8 x h / tp) per token."""
    cfg = hf_config(model)
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    return act_bytes * tokens * batch * (3 * hidden + 8 * hidden // rollout_tp)


@dataclass(frozen=True)
class MemoryReport:
    """Per-GPU memory in bytes (the fullest GPU: first pipeline stage, or the largest stage's parameters)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int  # under the chosen recompute mode
    activations_no_recompute: int
    activations_full_recompute: int
    rollout_weights: int  # 0 when the rollout engine has its own GPUs
    rollout_activations: int
    reserve: int  # CUDA context, communication buffers, allocator fragmentation
    capacity: int
    rollout_asleep: bool = False  # the engine frees its weights during the update (vLLM-Omni's sleep)

    @property
    def total(self) -> int:
        """Peak bytes: the training state plus the larger of the two phases a colocated GPU runs in turn:
        rollout (engine weights + its working set) and update (activations, + the engine's weights unless it
        sleeps)."""
        resident = self.parameters + self.gradients + self.optimizer_states + self.reserve
        rollout_phase = self.rollout_weights + self.rollout_activations
        update_phase = self.activations + (0 if self.rollout_asleep else self.rollout_weights)
        return resident + max(rollout_phase, update_phase)

    @property
    def fits(self) -> bool:
        """Whether the peak fits in the GPU's memory."""
        return self.total <= self.capacity
