"""Which registered model family a diffusers folder holds.

The families and what conversion needs of them (diffusers class, architecture check, name mapping, Megatron
shapes, presets) are the model_providers registry's bundles (`model_providers.registry.ModelFamily`); this
file only reads a folder's config and finds the bundle whose `diffusers_class` it names (the registry knows the
classes without importing the families, so only the family a folder holds is imported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_omni.checkpoint.errors import CheckpointError
from model_providers.registry import ModelFamily, diffusers_classes, get_family


def convertible_families() -> list[ModelFamily]:
    """The registered families with a diffusers conversion (a `diffusers_class` and its mapping), by name."""
    return [get_family(name) for name in sorted(diffusers_classes().values())]


def family_of_config(config: dict[str, Any], where: str) -> ModelFamily:
    """The family of a diffusers transformer config (its `_class_name`); `where` names the file for errors,
    which name the known families and their classes."""
    cls = config.get("_class_name")
    if cls is None:
        raise CheckpointError(f"{where} has no '_class_name': cannot tell the model family")
    known = diffusers_classes()
    if cls in known:
        fam = get_family(known[cls])
        try:
            fam.arch_config(config)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{where}: {exc}") from exc
        return fam
    raise CheckpointError(f"{where}: unknown model family (class {cls!r}); supported classes: {sorted(known)} "
                          f"(known families: {sorted(known.values())})")


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
    """A diffusers transformer folder, possibly inside a pipeline folder (as its `component`: `transformer`, or a
    Wan2.2 A14B pipeline's trained low-noise expert `transformer_2`)."""

    transformer_dir: Path
    pipeline_dir: Path | None
    config: dict[str, Any]
    family: ModelFamily
    component: str = "transformer"


def trained_component(pipeline_dir: str | Path) -> str:
    """The pipeline component the trainer's transformer is: `transformer`, or a two-expert (Wan2.2 A14B) pipeline's
    low-noise expert (`model_providers.wan.experts.TRAINED_EXPERT`). A half-declared pair (a second transformer
    without `boundary_ratio`, or the reverse) is refused by name, as the rollout engine refuses it."""
    from model_providers.wan.experts import TRAINED_EXPERT, read_two_experts

    read_json(Path(pipeline_dir) / "model_index.json")  # a missing or malformed index named as the converter names it
    try:
        experts = read_two_experts(pipeline_dir)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return "transformer" if experts is None else TRAINED_EXPERT


def resolve_diffusers_folder(path: str | Path) -> DiffusersSource:
    """Find the transformer of a diffusers transformer folder (config.json) or pipeline folder
    (model_index.json with a `transformer` entry) and its family. A two-expert (Wan2.2 A14B) pipeline's is its
    trained expert, the low-noise `transformer_2` (`model_providers.wan.experts.TRAINED_EXPERT`): what the trainer's
    checkpoints hold, and the slot an exported one goes back into."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a folder")
    pipeline_dir = None
    if (root / "model_index.json").is_file():
        index = read_json(root / "model_index.json")
        entry = index.get("transformer")
        if not entry:
            raise CheckpointError(f"{root / 'model_index.json'} lists no 'transformer' component")
        pipeline_dir, root = root, root / trained_component(root)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root} has neither config.json (a transformer) nor model_index.json (a pipeline)")
    config = read_json(cfg_path)
    return DiffusersSource(root, pipeline_dir, config, family_of_config(config, str(cfg_path)),
                           root.name if pipeline_dir is not None else "transformer")
