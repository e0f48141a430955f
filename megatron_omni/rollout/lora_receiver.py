"""The engine side of the adapter-only LoRA sync (`rollout.lora_sync=adapter`): the first sync goes through the
engine's own LoRA loader, every later one is one foreach copy into views of a flat buffer, and every one ends with
the engine's account of which modules carry the adapter.

An engine receives the trainer's adapters as diffusers peft keys (`<module>.lora_A.weight` [r, in],
`<module>.lora_B.weight` [out, r]; a value may also be a view with more leading dims whose rows, flattened, are
the key's rows: a fused qkv's q/k/v part as [heads, head_dim, r], which the trainer reads without copying).

- First sync: the engine's own loader binds the adapters (diffusers' `load_lora_adapter` through peft here;
  vLLM-Omni's LoRA request path in `vllm_omni.lora`), then every adapter tensor the engine computes with is moved
  into one flat buffer as a view of it (`FlatAdapters`: same values, same modules, one storage).
- Every sync: `CopyPlan` copies each key's tensor into its views with one `torch._foreach_copy_` (the plan is
  built once per key order and reused while the trainer sends the same keys), not one Python-level copy per
  module: that per-module overhead was most of a small model's sync.
- The proof, after every sync: a module carries the adapter when it is still the model's submodule under its name,
  still has the adapter active, and still computes with the buffer views the copy wrote. The engine returns (modules
  carrying the adapter, keys written); the trainer compares both with what it trains
  (`bridge.lora_sync.LoRAAdapterSync.deliver`), so an adapter bound to no module, unloaded, replaced or not written
  raises there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

# The name of the adapter the trainer's LoRA sync loads into the engine's transformer (peft).
LORA_ADAPTER = "megatron_omni"


def module_of(key: str) -> str:
    """The module name of a peft key (`a.b.lora_A.weight` -> `a.b`)."""
    return key.rsplit(".lora_", 1)[0]


def submodule(root: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """`root.get_submodule(name)`, or None, by plain lookups in each level's child table."""
    m: torch.nn.Module | None = root
    for part in name.split("."):
        m = m._modules.get(part)
        if m is None:
            return None
    return m


class ModulePaths:
    """Whether modules are still where they were found: every (parent, child name, child) link on their paths from
    `root`, each shared link checked once (`get_submodule` per module costs more than a small model's copies)."""

    def __init__(self, root: torch.nn.Module, names: Sequence[str]) -> None:
        self.root = root
        links: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.nn.Module]] = {}
        for name in names:
            parent = root
            for part in name.split("."):
                child = parent._modules[part]
                links[(id(parent), part)] = (parent, part, child)
                parent = child
        self.links = list(links.values())

    def intact(self) -> bool:
        """Every link as it was (so every module is still `root`'s submodule under its name)."""
        return all(parent._modules.get(part) is child for parent, part, child in self.links)

    def present(self, name: str, module: torch.nn.Module) -> bool:
        """Whether `module` is `root`'s submodule `name` now (for naming what moved once `intact` fails)."""
        return submodule(self.root, name) is module


class FlatAdapters:
    """Tensors moved into one flat buffer: `views[i]` holds `tensors[i]`'s values in `buffer` (all of one dtype
    and device). The engine then points its modules at the views; `addresses` are the views' storage addresses,
    which the proof compares with what the modules compute with."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("no adapter tensors to hold")
        dtypes, devices = {t.dtype for t in tensors}, {t.device for t in tensors}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"adapter tensors of several dtypes {dtypes} or devices {devices}")
        self.buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtypes.pop(), device=devices.pop())
        self.views: list[torch.Tensor] = []
        offset = 0
        for t in tensors:
            view = self.buffer[offset:offset + t.numel()].view(t.shape)
            view.copy_(t)
            self.views.append(view)
            offset += t.numel()
        self.addresses = [v.data_ptr() for v in self.views]


def _stacked(t: torch.Tensor, n: int, step: int) -> torch.Tensor:
    """[n, *t.shape]: `t` and the n - 1 tensors like it `step` elements apart in its storage (a view)."""
    return t.as_strided((n, *t.shape), (step, *t.stride()), t.storage_offset())


def _step(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Elements from `a` to `b` when `b` is laid out like `a` in the same storage, else None."""
    if (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return None
    return b.storage_offset() - a.storage_offset()


def merged_copies(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> tuple[list, list]:
    """The copies `srcs[i] -> dsts[i]` with each run of destinations laid out one step apart in one storage, whose
    sources are too (a fused qkv's q, k, v parts of B; its A copied to three modules: step 0), merged into one copy
    between [n, ...] views of the run. Destinations of a run never overlap (a step of at least one's extent)."""
    order = sorted(range(len(dsts)), key=lambda i: (dsts[i].untyped_storage().data_ptr(), dsts[i].storage_offset()))
    out_d, out_s, i = [], [], 0
    while i < len(order):
        d0, s0 = dsts[order[i]], srcs[order[i]]
        extent = 1 + sum((k - 1) * st for k, st in zip(d0.shape, d0.stride(), strict=True))
        n, d_step, s_step = 1, 0, 0
        while i + n < len(order):
            ds, ss = _step(d0, dsts[order[i + n]]), _step(s0, srcs[order[i + n]])
            if ds is None or ss is None:
                break
            if n == 1:
                if ds < extent or ss < 0:
                    break
                d_step, s_step = ds, ss
            elif ds != n * d_step or ss != n * s_step:
                break
            n += 1
        out_d.append(d0 if n == 1 else _stacked(d0, n, d_step))
        out_s.append(s0 if n == 1 else _stacked(s0, n, s_step))
        i += n
    return out_d, out_s


@dataclass
class CopyPlan:
    """Where each key's tensor goes: for the keys `keys` (in the order the trainer sends them), `dsts[i]` is a
    view of the engine's flat buffer shaped like the (sliced) source, `slicers[i]` picks this engine rank's part of
    the full tensor (None: all of it), and the tensors of `scaled` are multiplied by `scale` after the copy
    (vLLM folds alpha / r into B). Built once per key order by the engine (`LoRARouter.plan`)."""

    keys: tuple[str, ...]
    dsts: list[torch.Tensor]
    slicers: list[Callable[[torch.Tensor], torch.Tensor] | None]
    shapes: list[torch.Size]
    scaled: list[torch.Tensor] = field(default_factory=list)
    scale: float = 1.0
    source: Mapping[str, torch.Tensor] | None = None  # the state the plan was built from

    def __post_init__(self) -> None:
        self.modules = [module_of(k) for k in self.keys]
        # the copies from `source` itself (its tensors keep their storage: the trainer's adapter views), merged
        self.merged = None
        if self.source is not None:
            srcs = [t if f is None else f(t) for t, f in zip(self.source.values(), self.slicers, strict=True)]
            self.merged = merged_copies(self.dsts, srcs)

    def written(self, carrying: Sequence[str]) -> list[str]:
        """The keys this plan writes into a module of `carrying`."""
        held = set(carrying)
        return [k for k, m in zip(self.keys, self.modules, strict=True) if m in held]

    @torch.no_grad()
    def run(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy `state` (the same keys in the same order as `keys`) into the views: one foreach copy (of the
        merged copies when `state` is the plan's own source, whose tensors keep their storage)."""
        if state is self.source:
            torch._foreach_copy_(*self.merged)
        else:
            srcs = list(state.values())
            if any(self.slicers):
                srcs = [t if s is None else s(t) for t, s in zip(srcs, self.slicers, strict=True)]
            if [t.shape for t in srcs] != self.shapes:
                bad = next(k for k, t, s in zip(self.keys, srcs, self.shapes, strict=True) if t.shape != s)
                raise ValueError(f"LoRA {bad}: shape changed since the first sync")
            torch._foreach_copy_(self.dsts, srcs)
        if self.scaled:
            torch._foreach_mul_(self.scaled, self.scale)


class LoRARouter:
    """Caches the `CopyPlan` of the key order the trainer sends. `destination(key, source)` (the engine's) returns
    (the view of its buffer shaped like the sliced source, the slicer or None, whether it is scaled); an unknown
    key raises KeyError naming it. `scaled_region`: one tensor holding every scaled destination (and otherwise
    only zeros), multiplied as one when a plan writes all of `scaled_keys`."""

    def __init__(self, destination: Callable[[str, torch.Tensor], tuple[torch.Tensor, Callable | None, bool]],
                 scale: float = 1.0, scaled_region: torch.Tensor | None = None,
                 scaled_keys: frozenset[str] = frozenset()) -> None:
        self.destination = destination
        self.scale = scale
        self.scaled_region, self.scaled_keys = scaled_region, scaled_keys
        self._plan: CopyPlan | None = None

    def plan(self, state: Mapping[str, torch.Tensor]) -> CopyPlan:
        """The plan for `state`'s keys (the cached one when the trainer sends the same state or the same keys)."""
        plan = self._plan
        if plan is not None and (state is plan.source or tuple(state) == plan.keys):
            return plan
        dsts, slicers, shapes, scaled = [], [], [], []
        for key, t in state.items():
            dst, slicer, is_scaled = self.destination(key, t)
            src = t if slicer is None else slicer(t)
            if dst.numel() != src.numel():
                raise ValueError(f"LoRA {key}: {tuple(src.shape)} does not fit the engine's {tuple(dst.shape)}")
            dst = dst.view(src.shape)
            dsts.append(dst)
            slicers.append(slicer)
            shapes.append(src.shape)
            if is_scaled:
                scaled.append(dst)
        if self.scaled_region is not None and self.scaled_keys.issubset(state):
            scaled = [self.scaled_region]
        self._plan = CopyPlan(tuple(state), dsts, slicers, shapes, scaled, self.scale, state)
        return self._plan


class AdapterReceiver:
    """An engine's adapters after their first load: `load` writes a state in place (`router`) and reports what
    carries it (`carrying`, the subclass's proof: `all_modules` itself when every module does)."""

    rank: int
    alpha: float
    router: LoRARouter
    all_modules: tuple[str, ...]

    def carrying(self) -> tuple[str, ...]:
        raise NotImplementedError

    @torch.no_grad()
    def load(self, state: Mapping[str, torch.Tensor], rank: int, alpha: float) -> tuple[tuple[str, ...], Sequence[str]]:
        """Write `state` into the adapters (one foreach copy); returns (modules carrying the adapter, keys written
        into a carrying module). Raises ValueError for a rank/alpha other than the first load's or a key or shape
        the engine does not hold."""
        if rank != self.rank or float(alpha) != self.alpha:
            raise ValueError(f"LoRA rank/alpha {rank}/{alpha} differ from the engine's {self.rank}/{self.alpha}")
        plan = self.router.plan(state)
        plan.run(state)
        carrying = self.carrying()
        return carrying, plan.keys if carrying is self.all_modules else plan.written(carrying)


class PeftLoRAReceiver(AdapterReceiver):
    """A diffusers transformer's adapters, loaded the first time by diffusers' own `load_lora_adapter` (peft,
    scale alpha / rank), then written in place through one flat buffer (see the module docstring). One per
    transformer (`load_lora_into` keeps it on the module)."""

    def __init__(self, transformer: torch.nn.Module, state: Mapping[str, torch.Tensor], rank: int, alpha: float,
                 dtype: torch.dtype) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.transformer, self.rank, self.alpha = transformer, rank, float(alpha)
        modules = sorted({module_of(k) for k in state})
        transformer.load_lora_adapter(
            {k: v.reshape(-1, v.shape[-1]).to(dtype) for k, v in state.items()}, prefix=None,
            adapter_name=LORA_ADAPTER,
            metadata={"r": rank, "lora_alpha": alpha, "target_modules": modules, "lora_dropout": 0.0})
        # found once, by a scan of the whole module tree after the injection
        found = {name: m for name, m in transformer.named_modules()
                 if isinstance(m, BaseTunerLayer) and LORA_ADAPTER in getattr(m, "lora_A", {})}
        # The buffer holds every A, then every B, in the order the trainer sends them: a fused qkv's q, k, v parts
        # then lie one step apart on both sides and copy as one (`merged_copies`).
        order = list(dict.fromkeys([module_of(k) for k in state if module_of(k) in found] + list(found)))
        linears = [(m, factor, getattr(found[m], factor)[LORA_ADAPTER]) for factor in ("lora_A", "lora_B")
                   for m in order]
        flat = FlatAdapters([linear.weight.data for _, _, linear in linears])
        self.views = {}
        for (m, factor, linear), view in zip(linears, flat.views, strict=True):
            linear.weight.data = view
            self.views[f"{m}.{factor}.weight"] = view
        # (name, module, its lora_A and lora_B linears, their weights' addresses in the flat buffer)
        n = len(order)
        self.expected = [(m, found[m], linears[i][2], linears[n + i][2], flat.addresses[i], flat.addresses[n + i])
                         for i, m in enumerate(order)]
        self.all_modules = tuple(order)
        self.flat = flat
        self.paths = ModulePaths(transformer, order)
        self.router = LoRARouter(self._destination)
        self.scale = self.alpha / rank
        for name, m, *_ in self.expected:
            if abs(m.scaling[LORA_ADAPTER] - self.scale) > 1e-12 * self.scale:
                raise ValueError(f"LoRA {name}: the engine's scale {m.scaling[LORA_ADAPTER]} != alpha / rank = "
                                 f"{self.scale}")

    def _destination(self, key: str, source: torch.Tensor) -> tuple[torch.Tensor, None, bool]:
        view = self.views.get(key)
        if view is None:
            raise KeyError(f"LoRA {key}: the engine has no adapted module {module_of(key)!r}")
        return view, None, False

    def carrying(self) -> tuple[str, ...]:
        """The modules that carry the adapter now: still the transformer's submodule under their name, the
        adapter active and unmerged, its scale alpha / rank, and its weights the flat buffer's views (`all_modules`
        itself when every module does). Read from peft's layer attributes directly: its properties cost more
        than the copies."""
        intact = self.paths.intact()
        ok = [(intact or self.paths.present(name, m)) and m._modules["lora_A"]._modules.get(LORA_ADAPTER) is la
              and m._modules["lora_B"]._modules.get(LORA_ADAPTER) is lb
              and la._parameters["weight"].data_ptr() == a_at and lb._parameters["weight"].data_ptr() == b_at
              and (m._active_adapter == LORA_ADAPTER or LORA_ADAPTER in m._active_adapter)
              and not m._disable_adapters and not m.merged_adapters and m.scaling.get(LORA_ADAPTER) == self.scale
              for name, m, la, lb, a_at, b_at in self.expected]
        if all(ok):
            return self.all_modules
        return tuple(e[0] for e, good in zip(self.expected, ok, strict=True) if good)


def load_lora_into(transformer: torch.nn.Module, state: Mapping[str, torch.Tensor], rank: int, alpha: float,
                   dtype: torch.dtype) -> tuple[Sequence[str], Sequence[str]]:
    """Load LoRA adapters given as diffusers peft keys into a diffusers transformer (`PeftLoRAReceiver`: the
    first call through diffusers' `load_lora_adapter`, then in place). Returns (the modules carrying the adapter,
    the keys written); the caller compares both with what it trained."""
    receiver = getattr(transformer, "_megatron_omni_lora", None)
    if receiver is None:
        receiver = PeftLoRAReceiver(transformer, state, rank, alpha, dtype)
        transformer._megatron_omni_lora = receiver
    return receiver.load(state, rank, alpha)


__all__ = ["AdapterReceiver", "CopyPlan", "FlatAdapters", "LORA_ADAPTER", "LoRARouter", "ModulePaths",
           "PeftLoRAReceiver", "load_lora_into", "merged_copies", "module_of", "submodule"]
