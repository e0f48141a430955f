"""vLLM-Omni's side of the adapter-only LoRA sync (`rollout.lora_sync=adapter`, `rollout.engine=vllm_omni`):
adapters bound by vLLM-Omni's own LoRA manager and layers, then rewritten in place after every step.

First sync (`VllmOmniLoRAReceiver.register`): the adapters become a `LoRARequest` that the worker adds
(`add_lora`, what vLLM-Omni's `DiffusionWorker` exposes) and activates (`DiffusionLoRAManager.set_active_adapter`,
what the worker does for every request that carries `sampling_params.lora_request`; the engine then sends that
request with every rollout request, so the worker keeps the adapter active). The manager asks the pipeline for
`_load_diffusion_lora_adapter`, its hook for adapters that are not a folder on disk: the receiver answers it for
its own request with a vLLM `LoRAModel` of the delivered tensors. vLLM-Omni then swaps the adapted linears for
its LoRA layers (`DiffusionMergedQKVParallelLinearWithLoRA`, `...ColumnParallel...`, `...RowParallel...`),
binds the adapters (its tensor-parallel slices, rank padding, alpha / r folded into B) and refuses an
incomplete binding. Names: a fused q/k/v part keeps diffusers' name (`to_q`), which the manager maps onto a
slice of `to_qkv`; other modules take vLLM-Omni's name from the bridge's rollout layout (`to_out`, not
diffusers' `to_out.0`).

Then the layers' stacked LoRA buffers are moved into one flat buffer as its views (`FlatAdapters`: every A, then
every B) and every sync is one foreach copy of this rank's slice of each tensor and one multiply of the B region by
alpha / r (`lora_receiver.LoRARouter`); the first is checked to write exactly what vLLM-Omni's own binding wrote. After
every sync the receiver reports the diffusers modules whose slice is active in a layer that is still the
transformer's submodule, still computes with the written views, while the manager's active adapter is this one.

The same code runs in a vLLM-Omni worker (GPU: the worker extension's `load_flowgrpo_lora`, called through
`collective_rpc`) and in the trainer's process on CPU (`vllm_omni.inline`: a worker without processes). vLLM and
vLLM-Omni are imported when a receiver registers.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_omni.rollout.lora_receiver import AdapterReceiver, FlatAdapters, LoRARouter, ModulePaths, module_of

LORA_NAME = "megatron-omni"
# The request's path: absolute (vLLM does not look an absolute path up on a model hub); nothing is read from it.
IN_MEMORY_PATH = "/megatron-omni/in-memory-lora"


def _narrow(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s 1/size of `t` along `dim` (a view)."""
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


class VllmOmniLoRAReceiver(AdapterReceiver):
    """The adapters of one vLLM-Omni worker's pipeline (see the module docstring). `worker`: has
    `model_runner.pipeline`, `lora_manager` and `add_lora(request)` (vLLM-Omni's `DiffusionWorker`, or
    `vllm_omni.inline`'s in-process one); `layout`: the bridge's vLLM-Omni rollout layout (`rule(hf name)`)."""

    def __init__(self, worker: Any, layout: Any) -> None:
        self.worker = worker
        self.pipeline = worker.model_runner.pipeline
        self.layout = layout
        self.request: Any = None
        self._pending: tuple[dict[str, torch.Tensor], Any] | None = None

    # ------------------------------------------------------------------ first sync: vLLM-Omni's request path
    def _route(self, module: str) -> tuple[str, int, str]:
        """(vLLM-Omni layer name, its slice, the layout's tp split) of a diffusers module."""
        param, rule = self.layout.rule(f"{module}.weight")
        return param.removesuffix(".weight"), (rule.part or 0), rule.split

    def _load_hook(self, previous: Any) -> Any:
        """The pipeline's `_load_diffusion_lora_adapter`: this receiver's request -> (LoRAModel, PEFTHelper) of the
        delivered tensors; any other request to the hook that was there before (None: vLLM-Omni reads a folder)."""
        from vllm.lora.lora_model import LoRAModel

        def load(lora_request: Any, lora_path: str, dtype: torch.dtype) -> Any:
            if self._pending is None or lora_request.lora_int_id != self.request.lora_int_id:
                return previous(lora_request=lora_request, lora_path=lora_path, dtype=dtype) if previous else None
            tensors, helper = self._pending
            self._pending = None
            model = LoRAModel.from_lora_tensors(lora_request.lora_int_id, tensors, helper,
                                                device=str(self.pipeline.device), dtype=dtype)
            return model, helper

        return load

    def register(self, state: Mapping[str, torch.Tensor], rank: int, alpha: float) -> None:
        """Bind `state` (diffusers peft keys) through vLLM-Omni's LoRA request path, then move the bound layers'
        buffers into one flat buffer and check the in-place copy reproduces the binding bit for bit."""
        from vllm.lora.layers import BaseLayerWithLoRA
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest
        from vllm_omni.lora.utils import stable_lora_int_id

        if getattr(self.worker, "lora_manager", None) is None:
            self.worker.init_lora_manager()
        manager = self.worker.lora_manager
        if manager is None:
            raise RuntimeError("the vLLM-Omni worker has no LoRA manager (its pipeline's LoRA is fused at load)")
        self.routes = {m: self._route(m) for m in dict.fromkeys(module_of(k) for k in state)}
        tensors = {}
        for key, t in state.items():
            module = module_of(key)
            layer, _, split = self.routes[module]
            # clone: vLLM folds alpha / r into B in place, and `t` may be a view of the trainer's parameter
            tensors[(module if split == "qkv" else layer) + key[len(module):]] = t.reshape(-1, t.shape[-1]).clone()
        targets = sorted({module_of(k) for k in tensors})
        helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": alpha,
                                       "target_modules": [re.escape(n) for n in targets]})
        self.request = LoRARequest(LORA_NAME, stable_lora_int_id(IN_MEMORY_PATH), IN_MEMORY_PATH)
        self.rank, self.alpha, self.manager = rank, float(alpha), manager
        previous = getattr(self.pipeline, "_load_diffusion_lora_adapter", None)
        self.pipeline._load_diffusion_lora_adapter = self._load_hook(previous)
        self._pending = (tensors, helper)
        if not self.worker.add_lora(self.request):
            raise RuntimeError("vLLM-Omni's worker did not add the LoRA adapter")
        manager.set_active_adapter(self.request, 1.0)

        transformer = self.pipeline.transformer
        names = sorted({layer for layer, _, _ in self.routes.values()})
        layers = {}
        for name in names:
            layer = transformer.get_submodule(name)
            if not isinstance(layer, BaseLayerWithLoRA):
                raise RuntimeError(f"vLLM-Omni did not replace {name} by a LoRA layer ({type(layer).__name__})")
            layers[name] = layer
        # every A, then every B: the Bs are one region of the buffer, scaled by one multiply
        stacked_a = [t for name in names for t in layers[name].lora_a_stacked]
        flat = FlatAdapters(stacked_a + [t for name in names for t in layers[name].lora_b_stacked])
        views_a, views_b = iter(flat.views[:len(stacked_a)]), iter(flat.views[len(stacked_a):])
        self.expected = []  # (layer name, layer, its A and B buffer tuples, [(slice, diffusers module)])
        for name in names:
            layer = layers[name]
            n = len(layer.lora_a_stacked)
            layer.lora_a_stacked = tuple(next(views_a) for _ in range(n))
            layer.lora_b_stacked = tuple(next(views_b) for _ in range(n))
            slices = sorted((s, m) for m, (lname, s, _) in self.routes.items() if lname == name)
            self.expected.append((name, layer, layer.lora_a_stacked, layer.lora_b_stacked, slices))
        self.all_modules = tuple(m for *_, slices in self.expected for _, m in slices)
        self.layers, self.flat = layers, flat
        self.paths = ModulePaths(transformer, names)
        b_region = flat.buffer[sum(t.numel() for t in stacked_a):]
        self.router = LoRARouter(self._destination, scale=self.alpha / rank, scaled_region=b_region,
                                 scaled_keys=frozenset(k for k in state if k.endswith("lora_B.weight")))
        bound = flat.buffer.clone()
        self.router.plan(state).run(state)
        if not torch.equal(flat.buffer, bound):
            raise RuntimeError("the in-place LoRA copy does not reproduce vLLM-Omni's own binding of the same "
                               "adapters (tensor-parallel slices or layout differ)")

    def _destination(self, key: str, source: torch.Tensor) -> tuple[torch.Tensor, Any, bool]:
        module = module_of(key)
        if module not in self.routes:
            raise KeyError(f"LoRA {key}: the engine has no adapted module {module!r}")
        name, s, split = self.routes[module]
        layer = self.layers[name]
        tp, rank = layer.tp_size, layer.tp_rank
        if key.endswith("lora_A.weight"):
            dst = layer.lora_a_stacked[s][0, 0, :self.rank, :]
            dim = 1 if split == "row" else None
        else:
            dst = layer.lora_b_stacked[s][0, 0, :, :self.rank]
            dim = 0 if split in ("qkv", "column") else None
        slicer = functools.partial(_narrow, dim=dim, rank=rank, size=tp) if dim is not None and tp > 1 else None
        return dst, slicer, key.endswith("lora_B.weight")

    # ------------------------------------------------------------------ every sync
    def carrying(self) -> tuple[str, ...]:
        """The diffusers modules carrying the adapter now (`all_modules` itself when every one does): the manager's
        active adapter is this one, and their slice is active in a layer that is still the transformer's submodule
        and computes with the written views: its stacked-buffer tuples are still the ones of the flat buffer's
        views (vLLM puts new tuples in whenever it allocates or moves the buffers; its other writes copy into
        them). vLLM-Omni's layers keep the active slices in `_diffusion_lora_active_slices`, which `apply` reads."""
        manager = self.manager
        if manager._active_adapter_id != self.request.lora_int_id or manager._suspended_adapter_id is not None:
            return ()
        intact = self.paths.intact()
        ok = [(intact or self.paths.present(name, layer)) and layer._diffusion_lora_suspended_slices is None
              and layer.lora_a_stacked is a_views and layer.lora_b_stacked is b_views
              for name, layer, a_views, b_views, _ in self.expected]
        out = [m for (_, layer, _, _, slices), good in zip(self.expected, ok, strict=True) if good
               for s, m in slices if layer._diffusion_lora_active_slices[s]]
        return self.all_modules if len(out) == len(self.all_modules) else tuple(out)

    def load(self, state: Mapping[str, torch.Tensor], rank: int,
             alpha: float) -> tuple[tuple[str, ...], Sequence[str]]:
        """Write `state` into the adapters (registering them the first time); returns (diffusers modules carrying
        the adapter, keys written into one of them)."""
        if self.request is None:
            self.register(state, rank, alpha)
        return super().load(state, rank, alpha)


__all__ = ["IN_MEMORY_PATH", "LORA_NAME", "VllmOmniLoRAReceiver"]
