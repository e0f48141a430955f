"""LoRA adapters on Megatron-Core's tensor-parallel linears, sharded the way the layer is.

For a linear `y = W x` an adapter adds `(alpha / r) B (A x)` with A [r, in] and B [out, r] (B starts at zero, so
an adapted model first computes what its base does). Under tensor parallelism the adapter follows its layer:

- column-parallel (W split by output rows, x whole on every rank): A is replicated and B split like W's rows.
  `A x` passes Megatron-Core's `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward),
  so A's gradient sums every rank's share and stays equal on all ranks, as the layer's input gradient does;
- row-parallel (W split by input columns, x split): A is split like W's columns and B replicated. The partial
  products `A_r x_r` are summed with `reduce_from_tensor_model_parallel_region` (the layer's own reduction)
  before B, so B sees the whole `A x` and its gradient is equal on all ranks.

The merged weight `W + (alpha / r) B A` of a rank is then its shard of the merged full weight, in the layer's
own layout (`merged_weight`): what a rollout engine that takes full weights receives through the bridge,
unchanged. Base weights are frozen; only adapters have gradients. `adapters_disabled` switches every adapter
off in a block of code (the KL reference is the base model: no second copy).

Megatron-LM / Megatron-Bridge name the two factors `linear_in` / `linear_out`; peft and diffusers `lora_A` /
`lora_B`: here `lora_a` (A, the down-projection) and `lora_b` (B, the up-projection).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import nn

from megatron_omni.models.patterns import matches_any, unmatched_targets


class LoRAAdapter(nn.Module):
    """The adapter of one parallel linear: `lora_a` [r, in_local], `lora_b` [out_local, r] (see the module
    docstring for which is split); `scale` = alpha / r. Attached as the linear's `lora` submodule."""

    def __init__(self, linear: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        if isinstance(linear, tensor_parallel.ColumnParallelLinear):
            self.parallel = "column"
        elif isinstance(linear, tensor_parallel.RowParallelLinear):
            self.parallel = "row"
        else:
            raise TypeError(f"LoRA adapts Megatron-Core Column/RowParallelLinear layers, got {type(linear).__name__}")
        out_local, in_local = linear.weight.shape
        self.tp_group = linear.tp_group
        tp_size = get_pg_size(self.tp_group)
        self.split = tp_size > 1
        dtype, device = linear.weight.dtype, linear.weight.device
        # peft's default: A ~ kaiming-uniform(a=sqrt(5)), B = 0. A row-parallel A is drawn whole and split, as
        # Megatron-Core initialises a split weight on CPU, so the adapter starts the same at every tp.
        row = self.parallel == "row"
        full_a = torch.empty(rank, in_local * tp_size if row else in_local, dtype=dtype, device=device)
        nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
        local_a = full_a.chunk(tp_size, dim=1)[get_pg_rank(self.tp_group)] if row else full_a
        self.lora_a = nn.Parameter(local_a.contiguous())
        self.lora_b = nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        split, replicated = (self.lora_a, self.lora_b) if row else (self.lora_b, self.lora_a)
        tensor_parallel.set_tensor_model_parallel_attributes(split, True, 1 if row else 0, 1)
        tensor_parallel.set_tensor_model_parallel_attributes(replicated, False, 0, 1)
        self.rank, self.alpha = rank, float(alpha)
        self.scale = self.alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        # A column-parallel layer that gathers its output (the MMDiT's adaln) returns the whole output: its
        # delta is gathered the same way; a row-parallel one fed the whole input scatters it first.
        self.gather_output = bool(getattr(linear, "gather_output", False))
        self.scatter_input = not getattr(linear, "input_is_parallel", True)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """[..., out] what the adapter adds to its linear's output (out_local columns, all of them when the
        linear gathers its output) for the linear's input x [..., in_local] (whole when it scatters it)."""
        if self.split and self.parallel == "row" and self.scatter_input:
            x = scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
        if self.split and self.parallel == "row" and self.training and isinstance(self.dropout, nn.Dropout):
            # x is this rank's slice of the input: its own dropout stream, as Megatron-Core drops split heads
            with tensor_parallel.get_cuda_rng_tracker().fork():
                x = self.dropout(x)
        else:
            # x is whole and the default stream is seeded alike on every tp rank: the same mask everywhere
            x = self.dropout(x)
        h = nn.functional.linear(x, self.lora_a)
        if self.split:
            h = (copy_to_tensor_model_parallel_region(h, group=self.tp_group) if self.parallel == "column"
                 else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        out = self.scale * nn.functional.linear(h, self.lora_b)
        if self.split and self.parallel == "column" and self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `W + scale B A` (fp32 product, in the weight's dtype): for a column-parallel layer
        `B_r A` (its rows), for a row-parallel one `B A_r` (its columns)."""
        return (weight.float() + self.scale * (self.lora_b.float() @ self.lora_a.float())).to(weight.dtype)


def _output_hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
    adapter: LoRAAdapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter.delta(args[0]).to(out.dtype), bias


def add_lora(model: nn.Module, targets: Sequence[str], rank: int, alpha: float, dropout: float = 0.0,
             seed: int | None = None, global_name: Callable[[str], str] = str,
             require_match: bool = True) -> list[str]:
    """Attach an adapter to every Column/RowParallelLinear of `model` whose module name matches one of the
    `targets` (fnmatch patterns over `global_name(local module name)`, e.g. "*.linear_qkv"), freeze every other
    parameter, and return the adapted (local) module names in order. Raises ValueError when a pattern matches
    no parallel linear (a misspelt target must not train nothing, as adapters bound to zero modules did for
    verl-omni #552).

    `seed`: each A is drawn from its own generator seeded by (seed, its global name), so an adapter starts the
    same whatever the tp/pp layout and whichever stage holds it, and the default RNG stream is left alone;
    None draws from the default generator. `global_name` maps a stage's local module name to the model's
    (a pipeline stage's first block is block `offset`). A pipeline stage may hold none of a pattern's modules
    when another stage holds them: pass `require_match=False` there and check the patterns against the whole
    model's names (`unmatched_targets`)."""
    linears = {global_name(name): m for name, m in model.named_modules()
               if isinstance(m, tensor_parallel.ColumnParallelLinear | tensor_parallel.RowParallelLinear)}
    local = {id(m): name for name, m in model.named_modules()}
    unmatched = unmatched_targets(targets, linears)
    if unmatched and require_match:
        raise ValueError(f"LoRA targets {unmatched} match no tensor-parallel linear of the model; its linears "
                         f"end in {sorted({n.rsplit('.', 1)[-1] for n in linears})}")
    adapted = [n for n in linears if matches_any(n, targets)]
    for p in model.parameters():
        p.requires_grad_(False)
    for name in adapted:
        linear = linears[name]
        if hasattr(linear, "lora"):
            raise ValueError(f"{name} already carries a LoRA adapter")
        gen = None if seed is None else torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        linear.lora = LoRAAdapter(linear, rank, alpha, dropout, generator=gen)
        linear.register_forward_hook(_output_hook)
    return [local[id(linears[name])] for name in adapted]


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name of a model is one of an adapter's factors (`<linear>.lora.lora_a|lora_b`)."""
    return ".lora.lora_" in name or name.startswith("lora.lora_")


def adapters(model: nn.Module) -> dict[str, LoRAAdapter]:
    """Every adapter of `model` by the name of the linear it adapts."""
    return {name: m.lora for name, m in model.named_modules() if isinstance(getattr(m, "lora", None), LoRAAdapter)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model: every adapter off inside the block (restored after, also on an exception)."""
    found = list(adapters(model).values())
    states = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(found, states, strict=True):
            a.enabled = state


@torch.no_grad()
def merged_weight(linear: nn.Module) -> torch.Tensor:
    """The weight shard `linear` computes with, its adapter merged in (the plain weight without an adapter)."""
    adapter = getattr(linear, "lora", None)
    return linear.weight.detach() if adapter is None else adapter.merged(linear.weight.detach())
