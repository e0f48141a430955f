"""Per-GPU memory of a FlowGRPO job (part of the dry-run planner): parameters, gradients, optimizer states,
activations, rollout-engine weights.

Parameter counts are derived here from how `megatron_omni/models/dit/layer.py` builds each linear (adaLN,
QKV and fc1 column-parallel: rows split over tp; the output projection and fc2 row-parallel: weight
columns split, bias replicated; QK norms replicated) and from which pipeline stage owns which layer (the
timestep embedder on every stage, the input projections on the first, the output ones on the last). A
unit test checks them against the provider's exact per-rank counts. LoRA adapters are counted exactly per rank
the same way (`lora_adapter_counts`: A and B sharded like their layer, models/lora.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_omni.models.patterns import matches_any, unmatched_targets
from megatron_omni.planner.arch import DiTArch, arch_of

_COLUMN = ("adaln.", "linear_qkv.", "linear_fc1.")
_ROW_WEIGHTS = ("linear_proj.weight", "linear_fc2.weight")
# FLUX's single-stream block: adaLN, QKV, the MLP input and the output projection over [attention | MLP] are
# column-parallel (models/dit/flux_layer.py), weights and biases split by rows.
_SINGLE_COLUMN = (*_COLUMN, "linear_out.")

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


def _stage_of(a: DiTArch, name: str, pp: int) -> range:
    """The pipeline stages that hold non-block tensor `name`."""
    if name.startswith(a.every_stage):
        return range(pp)
    if name.startswith(a.first_stage):
        return range(1)
    if name.startswith(a.last_stage):
        return range(pp - 1, pp)
    raise ValueError(f"planner memory model does not know which stage holds {name}")


def rank_parameter_counts(model: str | dict[str, Any] | DiTArch, tp: int, pp: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage at tensor-parallel size `tp` (index = stage); constant
    buffers (`DiTArch.buffers`: SD3's sincos table) are not parameters (`rank_buffer_counts`)."""
    a = arch_of(model)
    blocks, heads = a.blocks, a.heads
    if blocks % pp:
        raise ValueError(f"{blocks} blocks are not divisible by pp={pp}")
    if heads % tp:
        raise ValueError(f"{heads} heads are not divisible by tp={tp}")
    per_stage = blocks // pp  # stages split every block in model order (FLUX: the double ones, then the single)
    counts = [0] * pp
    for name, shape in a.shapes.items():
        n = math.prod(shape)
        if name in a.buffers:
            continue
        if name.startswith("layers."):
            layer, tensor = int(name.split(".")[1]), name.split(".", 3)[3]
            if tensor.startswith(_COLUMN) or tensor in _ROW_WEIGHTS:
                dim = 1 if tensor in _ROW_WEIGHTS else 0
                if shape[dim] % tp:
                    raise ValueError(f"{name} {shape}: dim {dim} is not divisible by tp={tp}")
                n //= tp
            counts[layer // per_stage] += n
        elif name.startswith("single_layers."):  # FLUX: every linear column-parallel (output rows split)
            if name.split(".", 2)[2].startswith(_SINGLE_COLUMN):
                if shape[0] % tp:
                    raise ValueError(f"{name} {shape}: dim 0 is not divisible by tp={tp}")
                n //= tp
            counts[(a.layers + int(name.split(".")[1])) // per_stage] += n
        else:
            for s in _stage_of(a, name, pp):
                counts[s] += n
    return counts


def rank_buffer_counts(model: str | dict[str, Any] | DiTArch, pp: int = 1) -> list[int]:
    """Elements of the constant buffers (replicated over tp, in the model's dtype) one rank of each stage holds."""
    a = arch_of(model)
    counts = [0] * pp
    for name in a.buffers:
        for s in _stage_of(a, name, pp):
            counts[s] += math.prod(a.shapes[name])
    return counts


# The block linears an adapter can go on (Megatron-Core parallel linears; the embedders and output layers are
# plain nn.Linear) and how each is split over tp: column-parallel ones (weight rows split) keep A [r, in]
# replicated and split B [out, r] by rows; row-parallel ones (weight columns split) split A by columns and keep
# B replicated (models/lora.py).
_LORA_COLUMN = ("adaln", "linear_qkv", "linear_fc1")
_LORA_ROW = ("linear_proj", "linear_fc2")


def lora_linears(model: str | dict[str, Any] | DiTArch) -> dict[str, tuple[int, int, bool]]:
    """Every linear LoRA can adapt, by module name (`layers.{i}.{img|txt|img_attn2}.{linear}`, block order):
    (out, in, row_parallel) of its full weight."""
    out = {}
    for name, shape in arch_of(model).shapes.items():
        if name.startswith("layers.") and name.endswith(".weight"):
            module = name[: -len(".weight")]
            linear = module.rsplit(".", 1)[1]
            if linear in _LORA_COLUMN or linear in _LORA_ROW:
                out[module] = (shape[0], shape[1], linear in _LORA_ROW)
    return out


@dataclass(frozen=True)
class AdapterCounts:
    """The adapters of one LoRA job: `modules` the adapted linears (whole model, block order), `total` their
    parameters (each tp shard once: r * (in + out) per linear), `per_stage` what one rank of each pipeline
    stage holds at the job's tp."""

    rank: int
    modules: tuple[str, ...]
    total: int
    per_stage: list[int]


def lora_adapter_counts(model: str | dict[str, Any] | DiTArch, tp: int, pp: int, rank: int, targets: Sequence[str]
                        ) -> AdapterCounts:
    """Exact adapter parameters of rank `rank` on the linears matching `targets` (fnmatch over module names),
    per rank of each stage at `tp`: column-parallel r * in (A, replicated) + out / tp * r (B, split); row-parallel
    r * in / tp (A, split) + out * r (B, replicated). Raises ValueError for a rank below 1 or a pattern that
    matches no linear (a misspelt target would otherwise plan, and train, nothing: `models.lora.add_lora`)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    a = arch_of(model)
    layers = a.layers
    if layers % pp:
        raise ValueError(f"{layers} blocks are not divisible by pp={pp}")
    linears = lora_linears(a)
    unmatched = unmatched_targets(targets, linears)
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no tensor-parallel linear of the model; its linears end "
                         f"in {sorted({n.rsplit('.', 1)[1] for n in linears})}")
    per_stage_blocks = layers // pp
    modules, total, stages = [], 0, [0] * pp
    for name, (n_out, n_in, row) in linears.items():
        if not matches_any(name, targets):
            continue
        split = n_in if row else n_out
        if split % tp:
            raise ValueError(f"{name} [{n_out}, {n_in}]: dim {int(row)} is not divisible by tp={tp}")
        modules.append(name)
        total += rank * (n_in + n_out)
        local = rank * n_in // tp + n_out * rank if row else rank * n_in + n_out // tp * rank
        stages[int(name.split(".")[1]) // per_stage_blocks] += local
    return AdapterCounts(rank, tuple(modules), total, stages)


def lora_activation_bytes(
    model: str | dict[str, Any] | DiTArch, *, rank: int, targets: Sequence[str], image_tokens_per_rank: int,
    text_tokens: int, micro_batch_samples: int, pp: int, in_flight: int, recompute: str, act_bytes: int = 2,
) -> int:
    """What the adapters add to the first stage's saved activations: each adapted linear keeps `A x` [tokens, r]
    for B's gradient (its input x is saved anyway, by the base layer or the adapter's A). adaLN sees one vector
    per sample; the last block's text projection and MLP do not run (`MMDiTLayer(text_output=False)`). Full
    recompute keeps them only for the block being recomputed. Adapter dropout's extra copy of x is not counted."""
    a = arch_of(model)
    layers = a.layers
    blocks = range(layers // pp)  # the first stage's
    per_block = [0] * len(blocks)
    for name in lora_linears(a):
        if not matches_any(name, targets):
            continue
        _, layer, stream, linear = name.split(".")
        layer = int(layer)
        if layer not in blocks:
            continue
        if linear == "adaln":
            tokens = 1
        elif stream == "txt" and layer == layers - 1 and linear != "linear_qkv":
            continue
        else:
            tokens = text_tokens if stream == "txt" else image_tokens_per_rank
        per_block[layer] += act_bytes * micro_batch_samples * tokens * rank
    if recompute == "full":
        return max(per_block, default=0)
    return in_flight * sum(per_block)


def rollout_parameter_count(model: str | dict[str, Any] | DiTArch, rollout_tp: int, buffers: bool = True) -> int:
    """Transformer parameters on one GPU of a vLLM-Omni rollout engine at tensor-parallel size `rollout_tp`, and
    its constant buffers unless `buffers=False` (what a weight sync sends: the buffers are never synced).

    vLLM-Omni splits the attention projections and the MLPs; adaLN, the QK norms, the row-parallel
    biases and all non-block layers are replicated (docs/design.md section 4), so adaLN's third of the model
    is on every rollout GPU.
    """
    a = arch_of(model)
    if a.heads % rollout_tp:
        raise ValueError(f"{a.heads} heads are not divisible by rollout tp={rollout_tp}")
    total = 0
    for name, shape in a.shapes.items():
        if name in a.buffers and not buffers:
            continue
        n = math.prod(shape)
        tensor = name.split(".", 3)[3] if name.startswith("layers.") else ""
        if tensor.startswith(("linear_qkv.", "linear_fc1.")) or tensor in _ROW_WEIGHTS:
            n //= rollout_tp
        total += n
    return total


def block_activation_bytes(
    hidden: int, tokens: int, samples: int, tp: int, recompute: str, act_bytes: int = 2,
    saved: dict[str, tuple[int, int]] | None = None,
) -> int:
    """Bytes one block keeps for its backward pass: `tokens` per sample on this rank (image shard + text),
    `samples` samples, under `recompute` ('none' | 'selective' | 'full'; full keeps only the inputs). `saved`: the
    family's `(full, tp_split)` multiples of h per token per mode (default: Qwen-Image's, `_SAVED_PER_TOKEN`)."""
    if recompute == "full":
        return act_bytes * tokens * samples * hidden
    saved = _SAVED_PER_TOKEN if saved is None else saved
    if recompute not in saved:
        raise ValueError(f"unknown recompute mode {recompute!r}; known: {RECOMPUTE_MODES}")
    full, split = saved[recompute]
    return act_bytes * tokens * samples * (full * hidden + split * hidden // tp)


def training_activation_bytes(
    model: str | dict[str, Any] | DiTArch, *, tokens_per_rank: int, micro_batch_samples: int, tp: int, pp: int,
    in_flight: int, recompute: str, act_bytes: int = 2, image_tokens_per_rank: int = 0,
) -> int:
    """Peak activation bytes on the first pipeline stage (the fullest under 1F1B).

    tokens_per_rank: image tokens / cp + text tokens; micro_batch_samples: samples in one micro-batch
    (CFG doubles them); in_flight: micro-batches whose activations the stage holds at once
    (min(pp, micro-batches) under 1F1B, 1 without pipelining); image_tokens_per_rank: image tokens / cp, which the
    second image attention of `DiTArch.image_attention_layers` blocks (SD3.5-M) saves more for.
    """
    a = arch_of(model)
    hidden = a.hidden
    per_block = block_activation_bytes(hidden, tokens_per_rank, micro_batch_samples, tp, recompute, act_bytes,
                                       a.saved_per_token)
    if a.single_layers:  # FLUX: the single-stream blocks over [text; image] after the double ones
        # The first stage's blocks in model order: the double ones first, then single ones if it reaches them.
        stage_blocks = a.blocks // pp
        doubles = min(a.layers, stage_blocks)
        singles = stage_blocks - doubles
        single_saved = {"none": a.single_saved}
        single = [block_activation_bytes(hidden, tokens_per_rank, micro_batch_samples, tp, mode, act_bytes,
                                         single_saved) for mode in ("none", recompute)]
        double_none = block_activation_bytes(hidden, tokens_per_rank, micro_batch_samples, tp, "none", act_bytes,
                                             a.saved_per_token)
        held = in_flight * (doubles * per_block + singles * single[1])
        if recompute == "full":  # the block being recomputed holds its full set once
            held += max(double_none if doubles else 0, single[0] if singles else 0)
        return held
    blocks = a.layers // pp
    dual = sum(1 for i in a.image_attention_layers if i < blocks)  # on the first stage
    extra = 0
    if dual and recompute != "full":
        full, split = a.image_attention_saved
        extra = act_bytes * image_tokens_per_rank * micro_batch_samples * (full * hidden + split * hidden // tp)
    held = in_flight * (blocks * per_block + dual * extra)
    if recompute == "full":  # the block being recomputed holds its full set once
        held += block_activation_bytes(hidden, tokens_per_rank, micro_batch_samples, tp, "none", act_bytes,
                                       a.saved_per_token)
        if dual:
            full, split = a.image_attention_saved
            held += act_bytes * image_tokens_per_rank * micro_batch_samples * (full * hidden + split * hidden // tp)
    return held


def rollout_activation_bytes(
    model: str | dict[str, Any] | DiTArch, *, tokens: int, batch: int, rollout_tp: int, act_bytes: int = 2
) -> int:
    """Working set of one inference forward (no grad): the live tensors of one block at its widest point
    (residual, modulated input, gated branch: 3 x h; fc1 and GELU outputs: 8 x h / tp) per token."""
    hidden = arch_of(model).hidden
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
