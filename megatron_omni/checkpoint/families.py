"""Model families the checkpoint tools know, and how a diffusers folder says which one it holds.

A family bundles what conversion needs from a model provider: the diffusers class name, the architecture
config check, the name mapping (as data), the full Megatron shapes and the presets. Only the provider
modules know the layouts; this file only registers them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_omni.checkpoint.errors import CheckpointError
from model_providers.qwen_image import mapping as qwen_mapping
from model_providers.qwen_image import presets as qwen_presets
from model_providers.qwen_image import provider as qwen_provider


@dataclass(frozen=True)
class ModelFamily:
    """How one model family converts between diffusers and Megatron names."""

    name: str
    diffusers_class: str
    arch_config: Callable[[dict[str, Any]], dict[str, Any]]  # full diffusers config -> architecture keys
    mappings: Callable[[int], list[qwen_mapping.ParamMapping]]  # num_layers -> mappings
    megatron_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    hf_to_megatron: Callable[..., Any]
    megatron_to_hf: Callable[..., Any]
    presets: dict[str, dict[str, Any]]

    def num_heads(self, config: dict[str, Any]) -> int:
        return int(self.arch_config(config)["num_attention_heads"])

    def num_layers(self, config: dict[str, Any]) -> int:
        return int(self.arch_config(config)["num_layers"])

    def preset_name(self, config: dict[str, Any]) -> str | None:
        """The preset whose architecture equals `config`, or None for a custom shape."""
        arch = self.arch_config(config)
        for name, preset in self.presets.items():
            if self.arch_config(preset) == arch:
                return name
        return None


FAMILIES: dict[str, ModelFamily] = {
    "qwen_image": ModelFamily(
        name="qwen_image",
        diffusers_class="QwenImageTransformer2DModel",
        arch_config=qwen_provider.hf_config,
        mappings=qwen_mapping.all_mappings,
        megatron_shapes=qwen_provider.megatron_shapes,
        hf_to_megatron=qwen_mapping.hf_to_megatron,
        megatron_to_hf=qwen_mapping.megatron_to_hf,
        presets=qwen_presets.PRESETS,
    ),
}


def family(name: str) -> ModelFamily:
    """The registered family `name`."""
    if name not in FAMILIES:
        raise CheckpointError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_config(config: dict[str, Any], where: str) -> ModelFamily:
    """The family of a diffusers transformer config (its `_class_name`); `where` names the file for errors."""
    cls = config.get("_class_name")
    if cls is None:
        raise CheckpointError(f"{where} has no '_class_name': cannot tell the model family")
    for fam in FAMILIES.values():
        if fam.diffusers_class == cls:
            try:
                fam.arch_config(config)
            except (KeyError, ValueError) as exc:
                raise CheckpointError(f"{where}: {exc}") from exc
            return fam
    known = sorted(f.diffusers_class for f in FAMILIES.values())
    raise CheckpointError(f"{where}: unknown model family (class {cls!r}); supported classes: {known}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, with the file named in any error."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


@dataclass(frozen=True)
class DiffusersSource:
    """A diffusers transformer folder, possibly inside a pipeline folder."""

    transformer_dir: Path
    pipeline_dir: Path | None
    config: dict[str, Any]
    family: ModelFamily


def resolve_diffusers_folder(path: str | Path) -> DiffusersSource:
    """Find the transformer of a diffusers transformer folder (config.json) or pipeline folder
    (model_index.json with a `transformer` entry) and its family."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder")
    pipeline_dir = None
    if (root / "model_index.json").is_file():
        index = read_json(root / "model_index.json")
        entry = index.get("transformer")
        if not entry:
            raise CheckpointError(f"{root / 'model_index.json'} lists no 'transformer' component")
        pipeline_dir, root = root, root / "transformer"
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root} has neither config.json (a transformer) nor model_index.json (a pipeline)")
    config = read_json(cfg_path)
    return DiffusersSource(root, pipeline_dir, config, family_of_config(config, str(cfg_path)))
