"""LoRA adapters from the trainer into a rollout engine: adapter-only (the adapters' factors, gathered over tp
and pp, renamed to diffusers' peft keys) or merged (`W + scale B A` through the ordinary bridge plan).

The adapter-only path moves r * (in + out) numbers per adapted linear instead of in * out; the diffusers
engine loads it through its own peft LoRA loader, vLLM-Omni through its LoRA request path and LoRA layers, the
first time, and both in place after that (`rollout.lora_receiver`, `rollout.vllm_omni.lora`). Its names are
derived from the family's weight mappings, so a fused Megatron linear becomes every diffusers module it was
made of: `linear_qkv` (B rows interleaved per head q|k|v) -> `to_q`, `to_k`, `to_v`, each with the shared A and
its own rows of B (exact: `B_q A` is the q rows of `B A`). `export_lora` is the same conversion for a file.

Every sync is proven: the engine reports how many of its modules carry the adapter and which keys it wrote;
anything but exactly the expected modules is `LoRASyncError` (an adapter bound to zero modules while the
metrics looked fine was verl-omni #552).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.checkpoint.lora import LORA_A, LORA_B, diffusers_lora_state, lora_targets
from megatron_omni.models.lora import adapters, merged_weight


class LoRASyncError(RuntimeError):
    """The rollout engine does not carry exactly the adapters the trainer trains."""


def gather_adapters(found: Mapping[str, Any], tp_group: dist.ProcessGroup,
                    pp_group: dist.ProcessGroup) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every adapter of the whole model, full (gathered over tp: one flat all-gather of the split factors;
    then over pp: every stage's adapters), as {global linear name: (A [r, in], B [out, r])} on every rank.
    `found`: this stage's adapters ({global linear name: LoRAAdapter}). Collective over tp and pp."""
    tp = tp_group.size()
    full = {name: (a.lora_a.detach(), a.lora_b.detach()) for name, a in found.items()}
    split = [(name, a) for name, a in found.items() if a.split]
    if tp > 1 and split:
        pieces = [(a.lora_b if a.parallel == "column" else a.lora_a).detach() for _, a in split]
        flat = torch.cat([p.reshape(-1) for p in pieces])
        chunks = list(torch.empty(tp * flat.numel(), dtype=flat.dtype, device=flat.device).chunk(tp))
        dist.all_gather(chunks, flat, group=tp_group)
        off = 0
        for (name, a), piece in zip(split, pieces, strict=True):
            n = piece.numel()
            shards = [c[off:off + n].view(piece.shape) for c in chunks]
            off += n
            if a.parallel == "column":
                full[name] = (full[name][0], torch.cat(shards, dim=0))
            else:
                full[name] = (torch.cat(shards, dim=1), full[name][1])
    if pp_group.size() > 1:
        stages: list = [None] * pp_group.size()
        dist.all_gather_object(stages, {k: (a.cpu(), b.cpu()) for k, (a, b) in full.items()}, group=pp_group)
        device = next(iter(found.values())).lora_a.device if found else torch.device("cpu")
        full = {k: (a.to(device), b.to(device)) for stage in stages for k, (a, b) in stage.items()}
    return full


class MergedSources(Mapping):
    """A rank's Megatron tensors for the bridge with the adapters merged in: the weight of an adapted linear
    reads as its merged shard (`merged_weight`), computed when the bridge asks for it (one at a time, the last
    one kept for the plan's several pieces of it), every other tensor as it is. A `WeightSync` over these
    sources syncs the merged model as full weights (`rollout.lora_sync=merge`)."""

    def __init__(self, sources: Mapping[str, torch.Tensor], linears: Mapping[str, torch.nn.Module]) -> None:
        """`sources`: {global Megatron tensor name: tensor}; `linears`: {global weight name: adapted linear}."""
        self.sources = sources
        self.linears = linears
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        linear = self.linears.get(name)
        if linear is None:
            return self.sources[name]
        if self._last is None or self._last[0] != name:
            self._last = (name, merged_weight(linear))
        return self._last[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)

    def forget(self) -> None:
        """Drop the cached merged shard (after a sync, so the next sync reads the updated adapter)."""
        self._last = None


@dataclass
class LoRASyncStats:
    """One adapter sync on this rank: modules carrying the adapter, bytes handed to the engine, seconds."""

    modules: int
    bytes_loaded: int
    seconds: float


class LoRAAdapterSync:
    """Adapter-only sync of one rank's trained adapters into its engine (an object with `load_lora(state, rank,
    alpha) -> (modules carrying the adapter, keys written)`: `rollout.lora_receiver` for the diffusers engine,
    `rollout.vllm_omni.lora` for vLLM-Omni), checking after every sync that the engine's adapted modules are
    exactly `targets`' modules and every key was written.

    `linears`: the adapted Megatron linears' global names over the whole model (every stage's), in order.

    With one rank per model replica (tp = pp = 1) the adapters need no gathering: the state handed to the engine
    is views of the adapters' own parameters, built once and reused while their storage stays where it was (the
    optimizer updates them in place), so a sync is the engine's copy and its proof.
    """

    def __init__(self, model: torch.nn.Module, engine: Any, family: Any, hf_config: dict[str, Any],
                 linears: Sequence[str], rank: int, alpha: float, tp_group: dist.ProcessGroup,
                 pp_group: dist.ProcessGroup, global_name: Callable[[str], str]) -> None:
        self.model, self.engine = model, engine
        self.adapters = {global_name(n): a for n, a in adapters(model).items()}  # this stage's, found once
        self.num_heads = family.num_heads(hf_config)
        self.mappings = family.mappings_for(hf_config)
        self.megatron_to_hf = family.megatron_to_hf
        self.modules = sorted({t.module for t in lora_targets(self.mappings, linears)})
        self._module_set = frozenset(self.modules)
        self._keys = frozenset(f"{m}.{k}" for m in self.modules for k in (LORA_A, LORA_B))
        self.rank, self.alpha = rank, alpha
        self.tp_group, self.pp_group, self.global_name = tp_group, pp_group, global_name
        self._params = [p for a in self.adapters.values() for p in (a.lora_a, a.lora_b)]
        self._local = tp_group.size() == 1 and pp_group.size() == 1
        self._views: tuple[list[int], dict[str, torch.Tensor]] | None = None  # (parameter addresses, state)
        self._bytes: tuple[dict[str, torch.Tensor], int] | None = None  # (the last state delivered, its bytes)
        self._verified: tuple[Any, Any] = (None, None)  # the engine's last report that passed `_check`

    @torch.no_grad()
    def state(self) -> dict[str, torch.Tensor]:
        """The whole model's adapters as diffusers peft keys (`diffusers_lora_state`, views of the gathered
        adapters: a fused qkv's B parts as [heads, head_dim, r]). Collective over tp, pp."""
        full = gather_adapters(self.adapters, self.tp_group, self.pp_group)
        return diffusers_lora_state(full, self.mappings, self.megatron_to_hf, self.num_heads, own_storage=False)

    def _sync_state(self) -> dict[str, torch.Tensor]:
        if not self._local:
            return self.state()
        addresses = list(map(torch.Tensor.data_ptr, self._params))
        if self._views is None or self._views[0] != addresses:
            self._views = (addresses, self.state())
        return self._views[1]

    def sync(self) -> LoRASyncStats:
        """Gather the adapters, convert them to diffusers keys and `deliver` them. Collective over tp and pp."""
        t0 = time.perf_counter()
        stats = self.deliver(self._sync_state())
        stats.seconds = time.perf_counter() - t0
        return stats

    @torch.no_grad()
    def deliver(self, state: dict[str, torch.Tensor]) -> LoRASyncStats:
        """Load diffusers-keyed adapters into the engine; raises LoRASyncError when the engine's adapted modules
        or the keys it wrote differ from the trained adapters' (`self.modules`)."""
        t0 = time.perf_counter()
        carrying, written = self.engine.load_lora(state, self.rank, self.alpha)
        # An engine returns the same report objects while everything is in place: checked once, then known good.
        if carrying is not self._verified[0] or written is not self._verified[1]:
            self._check(carrying, written)
            self._verified = (carrying, written)
        if self._bytes is None or self._bytes[0] is not state:
            self._bytes = (state, sum(t.numel() * t.element_size() for t in state.values()))
        return LoRASyncStats(len(carrying), self._bytes[1], time.perf_counter() - t0)

    def _check(self, carrying: Sequence[str], written: Sequence[str]) -> None:
        """Raise LoRASyncError unless `carrying` is exactly the trained modules and `written` has every key."""
        held = set(carrying)
        if held != self._module_set or len(carrying) != len(held) or not self._keys.issubset(written):
            missing = sorted(self._keys.difference(written))
            lost = sorted(self._module_set - held)
            extra = sorted(held - self._module_set)
            raise LoRASyncError(
                f"LoRA sync: the engine carries the adapter on {len(held)} modules, the trainer trains "
                f"{len(self.modules)}" + (f"; not carrying: {lost[:6]}" if lost else "")
                + (f"; unexpected: {extra[:6]}" if extra else "")
                + (f"; not written: {missing[:6]}" if missing else ""))


def merged_linears(model: torch.nn.Module, global_name: Callable[[str], str]) -> dict[str, torch.nn.Module]:
    """{global weight name: adapted linear} of this stage (what `MergedSources` merges)."""
    modules = dict(model.named_modules())
    return {f"{global_name(n)}.weight": modules[n] for n in adapters(model)}


__all__ = ["LoRAAdapterSync", "LoRASyncError", "LoRASyncStats", "MergedSources", "gather_adapters",
           "merged_linears"]
