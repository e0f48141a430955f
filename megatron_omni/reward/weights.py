"""Checks and loaders for scorer weights on disk: every miss is a RewardWeightsError naming the path and what
was expected (the server and the trainer exit 2 with it before training), never a fallback to another model.

Loaders here take local paths only (`local_files_only=True`): nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megatron_omni.reward.errors import RewardWeightsError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def scorer_device(scorer: str, device: str | None) -> torch.device:
    """The torch device a worker's device string names (None or "cpu": the CPU, "type:index": that accelerator);
    RewardWeightsError naming the scorer when torch does not know it or this machine lacks it, so a scorer never
    silently computes elsewhere. Asks torch.accelerator, so no device type is named here (megatron_omni/parallel
    owns those) and the reward worker does not import the trainer's platform (megatron-core)."""
    if device is None or device == "cpu":
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise RewardWeightsError(f"{scorer}: device {device!r} is not a torch device ('cpu' or 'type:index')") from None
    present = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if present is None or dev.type != present.type or (dev.index or 0) >= torch.accelerator.device_count():
        have = f"{torch.accelerator.device_count()} x {present.type}" if present is not None else "no accelerator"
        raise RewardWeightsError(f"{scorer}: device {device!r} is not on this machine ({have})")
    return dev


def scorer_dtype(scorer: str, dtype: str) -> torch.dtype:
    """torch dtype of 'float32' | 'bfloat16' | 'float16'."""
    if dtype not in DTYPES:
        raise RewardWeightsError(f"{scorer}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def need_path(scorer: str, option: str, path: str | None, what: str) -> str:
    """`path` when it exists; RewardWeightsError naming the option, the path and `what` was expected."""
    if not path:
        raise RewardWeightsError(f"{scorer}: give {option}=<path> ({what}); there is no default model")
    if not os.path.exists(path):
        raise RewardWeightsError(f"{scorer}: {option}={path!r} does not exist (expected {what})")
    return path


def hf_config(scorer: str, option: str, folder: str, model_type: str, what: str) -> dict[str, Any]:
    """config.json of a transformers model folder, checked to be of `model_type`."""
    need_path(scorer, option, folder, what)
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise RewardWeightsError(f"{scorer}: {option}={folder!r} has no config.json (expected {what})")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise RewardWeightsError(f"{scorer}: {path} is not readable JSON: {exc}") from None
    if cfg.get("model_type") != model_type:
        raise RewardWeightsError(f"{scorer}: {option}={folder!r} holds a {cfg.get('model_type')!r} model "
                                 f"(architectures {cfg.get('architectures')}), expected {what}")
    return cfg


def need_processor_files(scorer: str, option: str, folder: str, what: str) -> None:
    """A CLIP processor folder: preprocessor_config.json and a tokenizer (tokenizer.json or vocab.json +
    merges.txt)."""
    need_path(scorer, option, folder, what)
    has = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    tokenizer = "tokenizer.json" in has or {"vocab.json", "merges.txt"} <= has
    if "preprocessor_config.json" not in has or not tokenizer:
        raise RewardWeightsError(f"{scorer}: {option}={folder!r} lacks preprocessor_config.json and/or a tokenizer "
                                 f"(tokenizer.json or vocab.json + merges.txt); expected {what}")


def need_tokenizer_files(scorer: str, option: str, folder: str, what: str) -> None:
    """A CLIP tokenizer folder (tokenizer.json or vocab.json + merges.txt)."""
    need_path(scorer, option, folder, what)
    has = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if not ("tokenizer.json" in has or {"vocab.json", "merges.txt"} <= has):
        raise RewardWeightsError(f"{scorer}: {option}={folder!r} has no tokenizer.json nor vocab.json + merges.txt "
                                 f"(expected {what})")


def load_state_dict(scorer: str, option: str, path: str, what: str) -> dict[str, torch.Tensor]:
    """A checkpoint file's tensors (torch .pt/.pth/.bin with weights_only, or .safetensors); a {'state_dict':
    ...} wrapper and 'module.' prefixes (DDP saves) are unwrapped."""
    need_path(scorer, option, path, what)
    if not os.path.isfile(path):
        raise RewardWeightsError(f"{scorer}: {option}={path!r} is not a file (expected {what})")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd: Any = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: name it, whatever the reader raised
        raise RewardWeightsError(f"{scorer}: cannot read {option}={path!r} as a checkpoint ({type(exc).__name__}: "
                                 f"{exc}); expected {what}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise RewardWeightsError(f"{scorer}: {option}={path!r} is not a state dict of tensors (expected {what})")
    return {k.removeprefix("module."): v for k, v in sd.items()}
