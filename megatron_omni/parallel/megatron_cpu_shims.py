"""The shims that make Megatron-Core 0.16.1 run on CPU with gloo (it was written for CUDA).

The list is what running it on CPU found necessary (docs/environment.md):

- `torch.cuda.current_device()` is used as a device argument for buffers -> returns the CPU device;
- `torch.cuda.synchronize()` in the pipeline p2p code -> a no-op (CPU work is synchronous);
- the model-parallel RNG tracker and its `_get/_set_cuda_rng_state` helpers -> CPU generator state;
- `device="cuda"` literals in the causal-mask helpers, the fused-softmax mask and the schedules'
  token counter -> the CPU device;
- the distributed optimizer sorts parameters by comparing `param.type()` with CUDA tensor type names
  ('torch.cuda.FloatTensor', ...) and moves its checkpoint gather buffers with `.cuda()` (as does the bf16
  wrapper without it, `Float16OptimizerWithFloat16Params`) -> the same
  code with the CPU type names and `.cpu()`; and its model-space ("fully_reshardable") checkpoint load
  copies every per-parameter state key, which with torch's Adam (no apex/TE here) includes `step`, absent
  from the checkpoint's tensors (the step travels in the param groups) -> the step is copied onto itself;
  and its `load_state_dict` gives every parameter's torch-Adam state the SAME `step` tensor, which torch's
  foreach Adam then increments once per parameter -> each parameter gets its own copy after loading.

The shims are idempotent and only ever applied when CUDA is absent; `platform.init_distributed` and
`platform.seed_everything` apply them.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch

_SHIMS_APPLIED = False


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_rng_tracker(base: type) -> type:
    """A `CudaRNGStatesTracker` that keeps CPU generator states, with the same add/fork behaviour."""

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _rebind_device_literal(fn: Callable) -> Callable:
    """A copy of `fn` whose globals see a `torch` proxy that maps device="cuda" to the CPU."""
    proxy = _TorchCpuProxy()
    glb = dict(fn.__globals__)
    glb["torch"] = proxy
    new_fn = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    new_fn.__kwdefaults__ = fn.__kwdefaults__
    new_fn.__dict__.update(fn.__dict__)
    new_fn.__wrapped__ = fn  # type: ignore[attr-defined]
    return new_fn


def _cpu_clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron-Core's `clip_grad_by_total_norm_fp32` without its CUDA-only type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _rebind_module(module: types.ModuleType) -> None:
    """Rebind every function and method defined in `module` (see `_rebind_device_literal`)."""
    for name, obj in list(vars(module).items()):
        if isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__:
            if not hasattr(obj, "__wrapped__"):
                new = _rebind_device_literal(obj)
                setattr(module, name, new)
                # Names imported elsewhere (e.g. `from .clip_grads import clip_grad_by_total_norm_fp32`).
                for other in (sys.modules.get("megatron.core.optimizer"), sys.modules.get(
                        "megatron.core.optimizer.optimizer")):
                    if other is not None and getattr(other, name, None) is obj:
                        setattr(other, name, new)
        elif isinstance(obj, type) and obj.__module__ == module.__name__:
            for attr, fn in list(vars(obj).items()):
                if isinstance(fn, types.FunctionType) and not hasattr(fn, "__wrapped__"):
                    setattr(obj, attr, _rebind_device_literal(fn))


class _TorchCpuProxy(types.ModuleType):
    """Looks like `torch`; tensor factories called with device="cuda" create CPU tensors instead."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full", "arange"):

            def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
                dev = kwargs.get("device")
                if dev is not None and torch.device(dev).type == "cuda":
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)

            return factory
        return attr


def _cpu_code_constants(value: Any) -> Any:
    """A code constant with 'torch.cuda.XTensor' strings renamed 'torch.XTensor'; code objects get the same
    treatment recursively, plus the attribute name `cuda` renamed `cpu` (see `_rebind_cuda_code`)."""
    if isinstance(value, str) and value.startswith("torch.cuda.") and value.endswith("Tensor"):
        return "torch." + value[len("torch.cuda."):]
    if isinstance(value, tuple):
        return tuple(_cpu_code_constants(v) for v in value)
    if isinstance(value, frozenset):
        return frozenset(_cpu_code_constants(v) for v in value)
    if isinstance(value, types.CodeType):
        names = tuple("cpu" if n == "cuda" else n for n in value.co_names)
        return value.replace(co_consts=tuple(_cpu_code_constants(c) for c in value.co_consts), co_names=names)
    return value


def _rebind_cuda_code(cls: type) -> None:
    """Methods of `cls` run on CPU tensors: `tensor.type()` compared with 'torch.cuda.FloatTensor' compares
    with 'torch.FloatTensor', `tensor.cuda()` becomes `tensor.cpu()` and `torch.cuda.current_device()`
    becomes `torch.cpu.current_device()` ('cpu').

    Only the code's constants and attribute names change (same globals, defaults and closure), so the logic
    stays Megatron's own. Checked against every use of "cuda" in megatron-core 0.16.1's
    `optimizer/distrib_optimizer.py` (type names, `current_device()`, one `.cuda()`): renaming attributes
    is only safe where each `.cuda` use has a `.cpu` counterpart with the same meaning.
    """
    for attr, raw in list(vars(cls).items()):
        wrapper = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        fn = raw.__func__ if wrapper else raw
        if not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__"):
            continue
        code = _cpu_code_constants(fn.__code__)
        if code == fn.__code__:
            continue
        new_fn = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        new_fn.__kwdefaults__ = fn.__kwdefaults__
        new_fn.__dict__.update(fn.__dict__)
        new_fn.__qualname__ = fn.__qualname__
        new_fn.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(cls, attr, wrapper(new_fn) if wrapper else new_fn)


def _keep_torch_adam_step(original: Callable) -> Callable:
    """`DistributedOptimizer._set_main_param_and_optimizer_states` that accepts state without `step`."""

    def _set_main_param_and_optimizer_states(self: Any, model_param: torch.Tensor, tensors: dict) -> None:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:  # load_state_dict has already set it from the param groups
                tensors = {**tensors, "step": state["step"]}
        original(self, model_param, tensors)

    _set_main_param_and_optimizer_states.__wrapped__ = original  # type: ignore[attr-defined]
    return _set_main_param_and_optimizer_states


def _untie_torch_adam_steps(original: Callable) -> Callable:
    """`DistributedOptimizer.load_state_dict` that leaves each parameter its own torch-Adam `step` tensor."""

    def load_state_dict(self: Any, state_dict: dict) -> None:
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    load_state_dict.__wrapped__ = original  # type: ignore[attr-defined]
    return load_state_dict


def apply_cpu_shims() -> None:
    """Make Megatron-Core 0.16.1 run on CPU (see the module docstring). Idempotent; CPU only."""
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED or torch.cuda.is_available():
        return
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    if not getattr(mcore_random.CudaRNGStatesTracker, "_megatron_omni_cpu", False):
        tracker = _make_cpu_rng_tracker(mcore_random.CudaRNGStatesTracker)
        tracker._megatron_omni_cpu = True
        mcore_random.CudaRNGStatesTracker = tracker
    # The tracker may have been created before the shim: rebuild it with the CPU class.
    mcore_random.initialize_rng_tracker(force_reset=True)

    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    for module, names in (
        (transformer_utils, ("get_default_causal_mask", "get_sliding_window_causal_mask")),
        (schedules, ("forward_backward_no_pipelining", "forward_backward_pipelining_with_interleaving",
                     "forward_backward_pipelining_without_interleaving")),
    ):
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None and not hasattr(fn, "__wrapped__"):
                setattr(module, name, _rebind_device_literal(fn))
    # The optimizer and grad clipping allocate their scalars with device="cuda" throughout.
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # First the helpers they call by module-global name, then the modules (rebinding copies their globals).
    original = mcore_utils.local_multi_tensor_l2_norm
    if not hasattr(original, "__wrapped__"):
        rebound = _rebind_device_literal(original)
        mcore_utils.local_multi_tensor_l2_norm = rebound
        for module in (clip_grads, mcore_optimizer):
            if getattr(module, "l2_norm_impl", None) is original:
                module.l2_norm_impl = rebound
    # Its grad-type assertion names the CUDA tensor type; same clipping, any device.
    original_clip = clip_grads.clip_grad_by_total_norm_fp32
    _cpu_clip_grad_by_total_norm_fp32.__wrapped__ = original_clip
    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "clip_grad_by_total_norm_fp32", None) is original_clip:
            module.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    # bf16 without the distributed optimizer: the mixed-precision wrapper checks parameters against CUDA type
    # names (its own methods have no device literals, so this rebinding is all they need; before the module's).
    _rebind_cuda_code(mcore_optimizer.Float16OptimizerWithFloat16Params)
    for module in (clip_grads, mcore_optimizer):
        _rebind_module(module)
    # The distributed optimizer sorts parameters by their CUDA tensor type name and gathers its state on CUDA.
    from megatron.core.optimizer import distrib_optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    _rebind_cuda_code(dist_opt)
    if not hasattr(dist_opt._set_main_param_and_optimizer_states, "__wrapped__"):
        dist_opt._set_main_param_and_optimizer_states = _keep_torch_adam_step(
            dist_opt._set_main_param_and_optimizer_states)
    if not hasattr(dist_opt.load_state_dict, "__wrapped__"):
        dist_opt.load_state_dict = _untie_torch_adam_steps(dist_opt.load_state_dict)
    # fused_softmax imports the mask helpers by name.
    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):
        if hasattr(fused_softmax, name):
            setattr(fused_softmax, name, getattr(transformer_utils, name))
    _SHIMS_APPLIED = True
