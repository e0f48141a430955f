"""Model families as data: a family is a `ModelFamily` bundle in `model_providers/<name>/family.py` (its
module-level `FAMILY`), looked up by name with `get_family`, so a trainer builds, loads and exports a model
without importing the family's modules and a new family is a new folder (and its line in `FAMILIES`), not a
trainer edit. Families load lazily: `FAMILIES` names each family, where its bundle lives and the keys it is
found by, and a family's modules are imported only when that family is asked for.

The bundle holds what this room (model_providers) owns: presets, the config from a preset, build, load and
export of the weights in their Hugging Face / diffusers layout, the Megatron weight shapes and, for a family
stored as a diffusers transformer folder, what checkpoint conversion needs (its diffusers class, the
architecture check and the name mapping; the checkpoint room reads them and keeps only the detection of
which family a folder holds). The sync plan
into a rollout engine lives in the bridge room (above this one in the import order) and is keyed by the
same family name there.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILY_KINDS = ("dit", "ar_dit", "mot")


@dataclass(frozen=True)
class RolloutRule:
    """One Hugging Face-named tensor -> one rollout parameter, and how the rollout's tensor parallelism splits
    it: "replicated" | "column" (rows) | "row" (columns) | "qkv" (a fused q/k/v parallel linear; `part` 0/1/2).
    Names are block-relative for block rules."""

    hf: str
    param: str
    split: str
    part: int | None = None


@dataclass(frozen=True)
class SameNameLayout:
    """The rollout layout of a plain torch module (a transformers / diffusers model, not tensor-parallel): every
    tensor whole, as the parameter of its own name; the bridge's coverage check names any that is missing."""

    kind: str = "diffusers"
    load_prefix: str = ""
    max_tp: int | None = 1

    def rule(self, hf_name: str) -> tuple[str, RolloutRule]:
        """(rollout parameter name, rule) of a Hugging Face tensor name: itself, replicated."""
        return hf_name, RolloutRule(hf_name, hf_name, "replicated")


@dataclass(frozen=True)
class WeightPart:
    """One part of a family's weights that the bridge syncs as a unit into one rollout module (the whole
    transformer of a DiT; the decoder, the connector and the DiT of the AR-DiT hybrid): shapes only.

    mappings: Megatron <-> Hugging Face name mappings (each with megatron, hf, kind in copy | fuse_qkv |
        fuse_gate_up, tp_dim, layer, stage).
    shapes: the full (unsharded) Megatron shape of every mapped tensor.
    num_heads / num_groups: attention heads and query groups of the fused qkv tensors (None: one per head).
    num_layers: blocks (the pipeline-stage split of `block` mappings).
    layout: rollout engine kind ("diffusers", "vllm_omni") -> its layout (`rule(hf_name)`, `load_prefix`,
        `max_tp`); raises KeyError for an engine that cannot hold this part.
    """

    mappings: list[Any]
    shapes: dict[str, tuple[int, ...]]
    num_heads: int
    num_layers: int
    layout: Callable[[str], Any]
    num_groups: int | None = None


@dataclass(frozen=True)
class TinyPipeline:
    """A family's offline tiny pipeline: `make(folder, seed)` writes a diffusers pipeline folder with seeded
    weights (no download); `transformer_config()` is its transformer's config (what a dry run plans with)."""

    make: Callable[[Path, int], Any]
    transformer_config: Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class DiTTraits:
    """What a DiT family's pipeline samples and which trainer features it supports, as data: the trainer and the
    config checks read these (`ModelFamily.traits`) instead of testing the family's name.

    pipeline_class: the `_class_name` of the family's diffusers pipeline `model_index.json` (how a
        `model.pipeline` folder says which family it holds).
    video: the pipeline samples videos (frames [F, 3, H, W] per sample): `rollout.num_frames` may exceed 1,
        rewards get frame strips, the run folder gets video files. False: images (num_frames 1).
    frame_multiple: `num_frames - 1` must be a multiple of it (the VAE's temporal compression; 1 for images).
    rollout_engines: the `rollout.engine` values that can sample the family.
    true_cfg: the rollout and the trainer apply true classifier-free guidance (`rollout.guidance_scale > 1`).
    flash_tail: the engine re-spaces the ODE tail after the window (MixGRPO-Flash, `algorithm.mixgrpo.flash_ratio`).
    text_dim_key: the transformer config key of the text states' width (what the probe batch's text has).
    token_channels: transformer config -> the channels of one packed latent token (the probe batch's latents).
    conditioned: each sample is conditioned on source images (image editing): prompts are records with an image
        (`model_providers.qwen_image_edit.data`), the trajectory carries the sources' latents
        (`Trajectory.cond_latents`).
    sample_panels: (prompts [N], images [N, 3, H, W]) -> (panels [N, 3, H', W'], caption texts [N]): what the
        run folder's sample grids show per sample (an edit family: source | output, with the instruction);
        None: the images with their prompts.
    pooled_dim_key: the transformer config key of the pooled text embedding's width, for a family conditioned on
        one (SD3.5's pooled CLIP embeddings, carried in the trajectory); None: no pooled embedding.
    planned: the dry-run planner has a cost model (memory, FLOPs) for the family; False: `--dry-run` refuses it.
    guidance_embeds_key: the transformer config key saying the model takes the distilled guidance scale as an input
        (FLUX.1-dev's `guidance_embeds`; the trajectory carries it); None: no family model takes one.
    negative_text: (prompt, negative prompt) -> the text whose embedding is that prompt's negative under true CFG
        (an edit record: the same sources read with the negative prompt as the instruction); None: the negative
        prompt itself.
    """

    pipeline_class: str
    token_channels: Callable[[dict[str, Any]], int]
    text_dim_key: str
    video: bool = False
    frame_multiple: int = 1
    rollout_engines: tuple[str, ...] = ("diffusers",)
    true_cfg: bool = True
    flash_tail: bool = True
    conditioned: bool = False
    sample_panels: Callable[[list[str], Any], tuple[Any, list[str]]] | None = None
    pooled_dim_key: str | None = None
    planned: bool = True
    guidance_embeds_key: str | None = None
    negative_text: Callable[[str, str], str] | None = None


@dataclass(frozen=True)
class ModelFamily:
    """One model family's entry points (each a function of the family's provider module).

    name: the family's folder name under model_providers/ (and the value of a `model.family` setting).
    kind: what the model is, which is what the trainer room picks its trainer by: "dit" (a diffusion
        transformer over text embeddings, trained by FlowGRPO) | "ar_dit" (an autoregressive decoder whose
        states condition a DiT, trained jointly over plan tokens and the SDE window).
    presets: the preset names `config` accepts.
    config: a preset name or config dict -> the family's model config (a diffusers dict for Qwen-Image,
        a `HybridConfig` for AR-DiT).
    build_model: (model config, ParallelGroups, backend) -> this rank's Megatron-Core model shards.
    load_state: (model, state) -> None: copy full Hugging Face-layout tensors into this rank's shards; `state`
        is what `export_state` returns (a dict, or a tuple of per-part dicts).
    export_state: model -> its full Hugging Face-layout tensors gathered over tp (collective; AR-DiT also takes
        `parts=` to gather only some of its parts).
    megatron_shapes: a preset name or config -> the Megatron parameter shapes (the planner's and layout
        checks' view of the model).
    megatron_config: (model config, tp=, pp=, ulysses=, ring=, params_dtype=, **overrides) -> the
        TransformerConfig `build_model` takes, for a family whose build takes one (None: `build_model` takes
        the model config itself).
    reference_model: (preset or config, seed=) -> a plain-torch model of the family (the rollout's own
        copy where the family has one; None otherwise).
    weight_parts: model config -> the `WeightPart`s the bridge syncs, by part name (one, "transformer", for a
        DiT); None: the family has no bridge plan.
    megatron_sources: model -> this rank's Megatron tensors (local tp shards of its stage, the parameters'
        storage, so a sync after an optimizer step reads the new values) by global Megatron name, per part.
    tiny_pipeline: the family's offline tiny pipeline (`model.pipeline=tiny`), or None.
    megatron_module: the class of the Megatron model `build_model` returns, as "dotted.module:ClassName", for a
        family stored as a diffusers transformer folder: how code holding a built model (its checkpoints) finds the
        family's mappings (`family_of_model`). A name, not the class: loading a bundle (a launch script's `--check`,
        a dry run) then never imports megatron-core (6 of a `--check`'s 8.4 CPU seconds).
    quantized_linears: fnmatch patterns of the diffusers-named linear modules a quantized rollout
        (`rollout.quantization`) runs in low precision: those the serving engine quantizes (empty: the family
        has no quantized rollout).
    traits: what a DiT family's pipeline samples and which trainer features it supports (`DiTTraits`); None for
        a family the DiT trainer does not train.
    trainer: for a family trained by a trainer of its own, the module (a dotted name, data: this room never
        imports the trainer room) that defines `build_trainer(cfg, groups, run_dir) -> (trainer, reward function
        or None)` and `check_config(cfg, planning=False)` (raises ValueError naming a setting the family cannot
        take; `planning`: a dry run, which needs no weights at hand); None: the trainer of the family's kind.

    The conversion fields (all None for a family without a diffusers transformer folder of its own):
    diffusers_class: the `_class_name` of the family's diffusers transformer config.json (how a folder says
        which family it holds).
    arch_config: a full diffusers transformer config (or a preset name) -> its architecture keys (with
        `num_layers` and `num_attention_heads`); raises KeyError/ValueError on a config the family cannot hold.
    mappings: num_layers -> the diffusers <-> Megatron name mappings (`ParamMapping`s: megatron, hf, kind), for a
        family whose tensors follow from the block count alone.
    config_mappings: a model config (a diffusers config dict or the Megatron config `megatron_config` builds) ->
        the mappings, for a family whose blocks differ by more than their count (SD3.5-M's dual-attention
        blocks); set instead of `mappings`. Callers use `mappings_for(config)`, which takes either.
    hf_to_megatron: (mapping, [diffusers tensors], num_heads) -> the full Megatron tensor.
    megatron_to_hf: (mapping, full Megatron tensor, num_heads, views=False) -> the diffusers tensors, in `mapping.hf`
        order; `views=True`: views of the Megatron tensor whose leading dims flattened are each diffusers tensor's
        rows (the adapter sync copies from them without an intermediate copy).
    """

    name: str
    kind: str
    presets: tuple[str, ...]
    config: Callable[[Any], Any]
    build_model: Callable[..., Any]
    load_state: Callable[[Any, Any], None]
    export_state: Callable[[Any], Any]
    megatron_shapes: Callable[[Any], dict[str, Any]]
    megatron_config: Callable[..., Any] | None = None
    reference_model: Callable[..., Any] | None = None
    weight_parts: Callable[[Any], dict[str, WeightPart]] | None = None
    megatron_sources: Callable[[Any], dict[str, dict[str, Any]]] | None = None
    tiny_pipeline: TinyPipeline | None = None
    megatron_module: str | None = None
    quantized_linears: tuple[str, ...] = ()
    traits: DiTTraits | None = None
    trainer: str | None = None
    diffusers_class: str | None = None
    arch_config: Callable[[Any], dict[str, Any]] | None = None
    mappings: Callable[[int], list[Any]] | None = None
    config_mappings: Callable[[Any], list[Any]] | None = None
    hf_to_megatron: Callable[..., Any] | None = None
    megatron_to_hf: Callable[..., Any] | None = None

    @property
    def convertible(self) -> bool:
        """Whether the family converts between a diffusers transformer folder and Megatron checkpoints."""
        return None not in (self.diffusers_class, self.arch_config, self.hf_to_megatron, self.megatron_to_hf) and (
            self.mappings is not None or self.config_mappings is not None)

    def mappings_for(self, config: Any) -> list[Any]:
        """The diffusers <-> Megatron mappings of a model: `config` is its diffusers config (dict) or the Megatron
        config its model was built with (anything with `num_layers`). `config_mappings` when the family declares
        it, else `mappings` of the block count."""
        if self.config_mappings is not None:
            return self.config_mappings(config)
        if self.mappings is None:
            raise ValueError(f"model family {self.name!r} declares no diffusers <-> Megatron mappings")
        return self.mappings(self.num_layers(config) if isinstance(config, dict) else int(config.num_layers))

    def _arch(self, config: dict[str, Any]) -> dict[str, Any]:
        if self.arch_config is None:
            raise ValueError(f"model family {self.name!r} has no diffusers conversion (no arch_config)")
        return self.arch_config(config)

    def num_heads(self, config: dict[str, Any]) -> int:
        """The attention heads of a diffusers config of this family."""
        return int(self._arch(config)["num_attention_heads"])

    def num_layers(self, config: dict[str, Any]) -> int:
        """The transformer blocks of a diffusers config of this family."""
        return int(self._arch(config)["num_layers"])

    def preset_name(self, config: dict[str, Any]) -> str | None:
        """The preset whose architecture equals `config`'s, or None for a custom shape."""
        arch = self._arch(config)
        return next((name for name in self.presets if self._arch(name) == arch), None)


@dataclass(frozen=True)
class FamilyEntry:
    """What the registry knows of a family without importing it: where its bundle lives and the two keys a family is
    found by from outside (a diffusers folder's `_class_name`, a built model's class), as names. `get_family`
    checks them against the bundle when it imports it, so the table cannot drift from the folders.

    module: the dotted module whose `FAMILY` is the bundle (`model_providers.<name>.family`).
    diffusers_class: the bundle's `diffusers_class` (None: no diffusers conversion).
    megatron_module: the bundle's `megatron_module`, "dotted.module:ClassName" (None: it has none).
    """

    name: str
    module: str
    diffusers_class: str | None = None
    megatron_module: str | None = None


# One line per model_providers/<name>/ folder with a family.py (a unit test holds the two equal). Importing the
# registry imports no family: a process that converts an SD3.5 folder or trains FLUX.1 never pays for the others'
# imports (Qwen-Image-Edit's processor pulls in transformers and scipy, BAGEL's provider its tokenizer stack).
FAMILIES: dict[str, FamilyEntry] = {e.name: e for e in (
    FamilyEntry("ar_dit", "model_providers.ar_dit.family"),
    FamilyEntry("bagel", "model_providers.bagel.family"),
    FamilyEntry("flux", "model_providers.flux.family", "FluxTransformer2DModel",
                "megatron_omni.models.dit.flux_model:FluxModel"),
    FamilyEntry("qwen_image", "model_providers.qwen_image.family", "QwenImageTransformer2DModel",
                "megatron_omni.models.dit.model:MMDiTModel"),
    FamilyEntry("qwen_image_edit", "model_providers.qwen_image_edit.family", None,
                "megatron_omni.models.dit.model:MMDiTModel"),
    FamilyEntry("sd3", "model_providers.sd3.family", "SD3Transformer2DModel",
                "megatron_omni.models.dit.sd3_model:SD3Model"),
    FamilyEntry("wan", "model_providers.wan.family", "WanTransformer3DModel",
                "megatron_omni.models.dit.wan_model:WanModel"),
)}


def family_names() -> list[str]:
    """The registered families' names (`FAMILIES`), sorted; imports none of them."""
    return sorted(FAMILIES)


def family_folders() -> list[str]:
    """The model_providers/<name>/ folders with a family.py (what `FAMILIES` must list), sorted."""
    root = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(root)])
                  if m.ispkg and (root / m.name / "family.py").exists())


def get_family(name: str) -> ModelFamily:
    """The bundle of family `name` (`model_providers/<name>/family.py`'s `FAMILY`), importing that family's module
    only. Raises ValueError naming the known families when there is none, and naming the mismatch when the bundle
    differs from its `FAMILIES` entry."""
    entry = FAMILIES.get(name)
    if entry is None:
        raise ValueError(f"unknown model family {name!r}; known: {family_names()}")
    family = importlib.import_module(entry.module).FAMILY
    where = f"{entry.module.replace('.', '/')}.py"
    if not isinstance(family, ModelFamily) or family.name != name:
        raise ValueError(f"{where} must define FAMILY = ModelFamily(name={name!r}, ...)")
    if family.kind not in FAMILY_KINDS:
        raise ValueError(f"{where}: kind {family.kind!r} is not one of {FAMILY_KINDS}")
    if family.kind == "dit" and family.traits is None:
        raise ValueError(f"{where}: a DiT family declares its traits (DiTTraits)")
    if family.kind == "mot" and family.trainer is None:
        raise ValueError(f"{where}: a MoT family names its trainer module (trainer=)")
    declared = (family.diffusers_class, family.megatron_module)
    if declared != (entry.diffusers_class, entry.megatron_module):
        raise ValueError(f"{where} declares (diffusers_class, megatron_module) {declared}, but the registry's "
                         f"FAMILIES entry says {(entry.diffusers_class, entry.megatron_module)}: make them equal")
    if entry.diffusers_class is not None and not family.convertible:
        raise ValueError(f"{where}: diffusers_class {entry.diffusers_class!r} needs arch_config, mappings and "
                         f"hf_to_megatron / megatron_to_hf")
    return family


def diffusers_classes() -> dict[str, str]:
    """diffusers `_class_name` -> the name of the family that converts it (the convertible families); imports
    none of them."""
    return {e.diffusers_class: e.name for e in FAMILIES.values() if e.diffusers_class is not None}


def family_of_model(model: Any) -> ModelFamily:
    """The registered family whose Megatron model class (`megatron_module`) `model` is an instance of (the first
    by name when several build it). Imports only that family: a family whose model class's module was never
    imported cannot have built `model`. Raises ValueError naming the model's class when no family builds it."""
    for name in family_names():
        path = FAMILIES[name].megatron_module
        if path is None:
            continue
        module, cls = path.split(":")
        if module in sys.modules and isinstance(model, getattr(sys.modules[module], cls)):
            return get_family(name)
    raise ValueError(f"no registered model family builds a {type(model).__name__} (ModelFamily.megatron_module)")
