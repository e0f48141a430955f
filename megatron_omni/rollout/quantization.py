"""Quantized rollout (`rollout.quantization`): the trainer keeps its precision, the rollout engine's copy of the
transformer samples in FP8, quantized again with NVIDIA ModelOpt after every weight sync.

`fp8` is FP8 E4M3 weights with one scale per output channel and FP8 E4M3 activations with one scale per token,
computed at run time (ModelOpt's `FP8_PER_CHANNEL_PER_TOKEN_CFG`; vLLM serves it as the ModelOpt algorithm
`FP8_PER_CHANNEL_PER_TOKEN`). It applies to the linears the model family names (`ModelFamily.quantized_linears`:
for Qwen-Image those vLLM-Omni builds with its quantization config; the modulations, embedders and the output
projection stay in full precision, vllm-omni #2728). Why these choices:

- Dynamic per-token activation scales need no calibration: nothing can go stale between syncs, and nothing
  needs a forward through an unquantized copy, which the FP8 engine on a GPU does not hold (its worker keeps
  only FP8 weights). Static per-tensor activation scales (`FP8_DEFAULT_CFG`) would need that calibration at
  every sync.
- Per-channel weight scales split exactly with vLLM's tensor parallelism: column and fused q/k/v shards take
  their rows' scales, row-parallel shards the full row's scale, so every rollout tp serves the same weights
  (per-tensor scales would need one shared scale per fused q/k/v, re-rounding two of the three).
- Weight-only INT8/INT4 are not offered: vLLM's ModelOpt loader has no INT8/INT4 linear algorithm, and its
  AWQ/GPTQ paths take another packing than ModelOpt's export, so vLLM-Omni could not serve them from the bridge.

Two ways to run it, one quantizer:
- fake quantization (`FakeQuantizedTransformer`): ModelOpt's quantizers inserted into a torch module (the
  embedded diffusers engine), which then computes in its own dtype on FP8-rounded weights and activations.
  After a sync only the weights' per-channel maxima change: `refresh` recomputes them in place (ModelOpt's
  max-calibration reduction, `reduce_amax`), which `benchmarks/quantized_rollout.py` measures against a
  rebuild and against ModelOpt's re-calibration;
- real FP8 weights (`fp8_checkpoint_items`): the bridge's full tensors become ModelOpt's FP8 export format
  (`<linear>.weight` in float8_e4m3fn, `<linear>.weight_scale` in fp32 per output channel; ModelOpt's
  `FP8QTensor`), which vLLM-Omni's FP8 linears load (`rollout/vllm_omni/fp8.py`).

Both round the same values: the fake-quantized weights equal the FP8 weights times their scales up to fp32
rounding (ModelOpt's fake quantizer multiplies by 448 / amax, its real one divides by amax / 448).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_omni.models.patterns import matches_any, unmatched_targets

QUANTIZATION_MODES = ("none", "fp8")
# vLLM's ModelOpt algorithm serving each mode (`quant_algo` of its ModelOpt config).
VLLM_MODELOPT_ALGOS = {"fp8": "FP8_PER_CHANNEL_PER_TOKEN"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Unit roundoff of float8_e4m3fn (3 mantissa bits, round to nearest): a normal value x rounds to x (1 + d), |d| <= u.
FP8_UNIT_ROUNDOFF = 2.0**-4


@dataclass(frozen=True)
class QuantizationSpec:
    """What a rollout engine quantizes: `mode` (one of QUANTIZATION_MODES) on the linear modules whose diffusers
    names match one of `linears` (fnmatch patterns, the family's `quantized_linears`)."""

    mode: str = "none"
    linears: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZATION_MODES:
            raise ValueError(f"unknown rollout quantization {self.mode!r}; expected one of {QUANTIZATION_MODES}")
        if self.enabled and not self.linears:
            raise ValueError(f"rollout quantization {self.mode!r} needs the model family's quantized linears; the "
                             "family names none (ModelFamily.quantized_linears)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def quantizes(self, module: str) -> bool:
        """Whether the linear module named `module` (a diffusers name) runs quantized."""
        return self.enabled and matches_any(module, self.linears)


def modelopt_config(spec: QuantizationSpec) -> dict[str, Any]:
    """The `mtq.quantize` config of `spec`: ModelOpt's FP8 per-channel / per-token quantizer attributes on the
    spec's linears, every other quantizer off."""
    import modelopt.torch.quantization as mtq

    if not spec.enabled:
        raise ValueError("rollout quantization 'none' has no ModelOpt config")
    base = mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG["quant_cfg"]

    def matcher(kind: str):
        return lambda name: name.endswith(f".{kind}") and spec.quantizes(name.rsplit(".", 1)[0])

    # No distributed sync of the scales: every rank calibrates the same weights to the same maxima, and ModelOpt's
    # sync all-reduces over the whole job, which a disaggregated job's trainer and rollout ranks reach at different
    # times (a hang).
    return {"quant_cfg": {"default": {"enable": False},
                          matcher("weight_quantizer"): {**base["*weight_quantizer"], "enable": True},
                          matcher("input_quantizer"): {**base["*input_quantizer"], "enable": True}},
            "algorithm": {"method": "max", "distributed_sync": False}}


@dataclass
class RefreshStats:
    """One re-quantization: weight quantizers refreshed and the seconds it took."""

    quantizers: int
    seconds: float


class FakeQuantizedTransformer:
    """A torch module (a diffusers transformer) fake-quantized in place by ModelOpt (`mtq.quantize`).

    Its linears keep their parameters (a weight sync writes them as before) and gain a weight and an input
    quantizer; the forward then rounds weights and activations to FP8. Raises ValueError when no linear of the
    module matches the spec's patterns, or when one of its patterns matches no linear (a family table that no
    longer names the module's layers).
    """

    def __init__(self, module: torch.nn.Module, spec: QuantizationSpec) -> None:
        import modelopt.torch.quantization as mtq

        linears = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
        unmatched = unmatched_targets(spec.linears, linears)
        if unmatched:
            raise ValueError(f"quantized-linear patterns {unmatched} match no linear of {type(module).__name__}")
        self.module = module
        self.spec = spec
        # No forward loop: the weights are calibrated from themselves, the activations' scales are dynamic.
        mtq.quantize(module, modelopt_config(spec), forward_loop=None)
        self.linears = {n: m for n, m in module.named_modules()
                        if spec.quantizes(n) and getattr(m, "weight_quantizer", None) is not None}
        if sorted(self.linears) != sorted(n for n in linears if spec.quantizes(n)):
            raise RuntimeError("ModelOpt did not insert quantizers into every linear the spec names")
        self.check_enabled()

    def check_enabled(self) -> int:
        """The number of quantized linears; raises RuntimeError naming one whose weight or input quantizer is off,
        or whose weight scales are missing (never calibrated)."""
        for name, m in self.linears.items():
            if not (m.weight_quantizer.is_enabled and m.input_quantizer.is_enabled):
                raise RuntimeError(f"the rollout transformer's {name} is not quantized (its quantizer is off)")
            if m.weight_quantizer.amax is None:
                raise RuntimeError(f"the rollout transformer's {name} has no weight scales")
        return len(self.linears)

    @torch.no_grad()
    def refresh(self) -> RefreshStats:
        """Re-quantize after the module's weights changed: each weight quantizer's per-channel maxima, computed
        as ModelOpt's max calibrator computes them (`reduce_amax` over the quantizer's reduction axes), written
        into its scale buffer in place."""
        from modelopt.torch.quantization.utils import convert_quantization_axis_to_reduce_axis, reduce_amax

        t0 = time.perf_counter()
        for m in self.linears.values():
            q, w = m.weight_quantizer, m.weight
            amax = reduce_amax(w, axis=convert_quantization_axis_to_reduce_axis(w, q.axis)).detach()
            q.amax.copy_(amax.to(q.amax.dtype))
        return RefreshStats(len(self.linears), time.perf_counter() - t0)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside, the module computes unquantized (the same weights without FP8 rounding): the probe's view of
        what the quantizer was given. Every quantizer is re-enabled on exit."""
        quantizers = [q for m in self.linears.values() for q in (m.weight_quantizer, m.input_quantizer)]
        for q in quantizers:
            q.disable()
        try:
            yield
        finally:
            for q in quantizers:
                q.enable()

    @torch.no_grad()
    def quantized_weights(self) -> dict[str, torch.Tensor]:
        """{linear name: the weight its forward uses (FP8-rounded, in the weight's dtype)}."""
        return {n: m.weight_quantizer(m.weight).detach().clone() for n, m in self.linears.items()}


def is_quantizer_state(name: str) -> bool:
    """Whether a state-dict key belongs to a ModelOpt quantizer (not a weight of the model)."""
    return "_quantizer." in name


def fp8_quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full weight [out, in] in ModelOpt's FP8 per-channel form: (float8_e4m3fn [out, in], fp32 scales [out]),
    weight ~ fp8 * scale[:, None], scale = max |row| / 448 (ModelOpt's `FP8QTensor`, computed in fp32). An
    all-zero row gets scale 1 (its FP8 values are 0 whatever the scale; 0 / 0 would be NaN)."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    if weight.ndim != 2:
        raise ValueError(f"an FP8 per-channel weight must be 2-D [out, in], got {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    qtensor, scale = FP8QTensor.quantize(w, scales=scale)
    return qtensor._quantized_data, scale.reshape(-1)


def fp8_checkpoint_items(items: Iterable[tuple[str, torch.Tensor]], quantized: Collection[str]
                         ) -> list[tuple[str, torch.Tensor]]:
    """Full diffusers-named tensors as a ModelOpt FP8 checkpoint holds them: each `<m>.weight` named in `quantized`
    (names without the `transformer.` prefix) becomes `<m>.weight` (float8_e4m3fn) and `<m>.weight_scale` (fp32
    [out], `fp8_quantize_weight`); every other tensor passes unchanged. A given `transformer.` prefix is kept."""
    out = []
    for name, t in items:
        if name.removeprefix("transformer.") in quantized:
            q, scale = fp8_quantize_weight(t)
            out += [(name, q), (name.removesuffix("weight") + "weight_scale", scale)]
        else:
            out.append((name, t))
    return out


def probe_relative_tolerance(spec: QuantizationSpec) -> float:
    """How far, relative to the velocity, a quantized engine's probe may sit from the unquantized model's.

    One FP8 product y' = sum w_i (1 + d_i) x_i (1 + e_i) with |d_i|, |e_i| <= u (weight and activation rounding,
    u = 2^-4) errs by at most (2u + u^2) sum |w_i x_i|: 12.9% of the product when its terms do not cancel. The
    whole network's velocity is a chain of such products whose roundings are independent and mostly average out
    (measured: 0.9% of the probe's velocity term on the tiny test model, 3.6% on the shipped text pipeline), so
    the bound of one product is the tolerance: well above what FP8 rounding does, below what a transformer with
    other weights gives.
    """
    if not spec.enabled:
        return 0.0
    u = FP8_UNIT_ROUNDOFF
    return 2 * u + u * u


def check_engine_probe(engine: Any, spec: QuantizationSpec, traj: Any, trainer_means: torch.Tensor,
                       tolerance: float, what: str) -> tuple[float, Any]:
    """An engine's probe forward of the probe batch `traj` against the trainer model's means [N, W, S, C]:
    `probe.check_probe` within `tolerance` (the two dtypes'), or for an engine that samples quantized (`spec`)
    `probe.check_quantized_probe` with the quantizer's bound (`probe_relative_tolerance`). Raises `ProbeMismatch`
    naming `what`. Returns the figure a sync reports (the unquantized view's difference from the trainer, else the
    quantized means') and the quantized measurement (`QuantizedProbe`; None for an unquantized engine)."""
    from megatron_omni.rollout.probe import check_probe, check_quantized_probe

    if not spec.enabled:
        return check_probe(engine.probe(traj), trainer_means, tolerance, what), None
    got = check_quantized_probe(engine.probe(traj), trainer_means, traj, tolerance, probe_relative_tolerance(spec),
                                what, engine.probe_unquantized(traj))
    return (got.quantization_diff if got.weights_diff is None else got.weights_diff), got


def quantized_names(names: Iterable[str], spec: QuantizationSpec) -> set[str]:
    """The `<m>.weight` names among `names` (diffusers tensor names, prefix `transformer.` optional) of the linears
    the spec quantizes."""
    return {n for n in names if n.endswith(".weight") and spec.quantizes(n.removeprefix("transformer.")[:-7])}
