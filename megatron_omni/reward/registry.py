"""One registry for every scorer, and `build_scorer(spec)` which understands all the ways to name one.

A spec is one of:
- a registered name: "ocr", "vlm_ocr", "jpeg_compressibility", "jpeg_incompressibility", the VLM judges
  "vlm_judge"/"unifiedreward" and "geneval" (vlm_scorers.py), "edit_text" (an edit's OCR + source kept,
  edit.py), and for videos sent as frame strips
  (video.video_strip) "video_ocr", "temporal_consistency";
- a user scorer by import path: "my_pkg.rewards:aesthetic" (see scorers.import_scorer);
- a weighted sum: "0.8*ocr+0.2*jpeg_compressibility" (weights default to 1: "ocr+jpeg_compressibility"); a term
  ending in "?" is optional ("0.7*pickscore+0.3*ocr?": a failing ocr is left out, reported, not fatal);
- a dict: {"name": spec, "kwargs": {...}} or {"weighted": [{"scorer": spec, "weight": w, "required": bool,
  "kwargs": {...}}, ...]}.

`kwargs` go to the scorer's constructor (for "ocr": reader options; for "vlm_ocr": base_url, model, ...).
`device` ("cpu" or "type:index", given to the server) reaches the scorers that can use it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.scorers import (
    JpegCompressibility,
    JpegIncompressibility,
    Scorer,
    WeightedSum,
    import_scorer,
)
from megatron_omni.reward.video import TemporalConsistency

ScorerFactory = Callable[..., Scorer]
_REGISTRY: dict[str, ScorerFactory] = {}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_TERM = re.compile(r"^\s*(?:([0-9eE.+\-]+)\s*\*\s*)?(\S+?)\s*$")


def register_scorer(name: str, factory: ScorerFactory, *, overwrite: bool = False) -> None:
    """Make `factory(**kwargs) -> Scorer` reachable as `name`."""
    if not _NAME.match(name) or ":" in name:
        raise RewardInputError(f"scorer name {name!r} must be an identifier-like word without ':'")
    if name in _REGISTRY and not overwrite:
        raise RewardInputError(f"scorer {name!r} is already registered")
    _REGISTRY[name] = factory


def available_scorers() -> list[str]:
    """Registered scorer names, sorted."""
    return sorted(_REGISTRY)


def _ocr(**kwargs: Any) -> Scorer:
    from megatron_omni.reward.ocr import OcrScorer  # rapidocr/onnxruntime load only when asked for

    return OcrScorer(**kwargs)


def _vlm_ocr(**kwargs: Any) -> Scorer:
    from megatron_omni.reward.ocr import OcrScorer

    return OcrScorer(reader="vlm", **kwargs)


def _video_ocr(**kwargs: Any) -> Scorer:
    from megatron_omni.reward.video import VideoOcrScorer

    return VideoOcrScorer(**kwargs)


def lazy(path: str) -> ScorerFactory:
    """A factory that imports "module:Class" only when the scorer is built (torch/transformers load on demand)."""

    def factory(**kwargs: Any) -> Scorer:
        module, _, attr = path.partition(":")
        return getattr(importlib.import_module(module), attr)(**kwargs)

    factory.__name__ = path
    return factory


register_scorer("ocr", _ocr)
register_scorer("vlm_ocr", _vlm_ocr)
register_scorer("video_ocr", _video_ocr)
register_scorer("temporal_consistency", TemporalConsistency)
register_scorer("jpeg_compressibility", JpegCompressibility)
register_scorer("jpeg_incompressibility", JpegIncompressibility)
register_scorer("pickscore", lazy("megatron_omni.reward.clip_scorers:PickScore"))
register_scorer("clipscore", lazy("megatron_omni.reward.clip_scorers:ClipScore"))
register_scorer("aesthetic", lazy("megatron_omni.reward.clip_scorers:Aesthetic"))
register_scorer("hpsv2", lazy("megatron_omni.reward.clip_scorers:HPSv2"))
register_scorer("imagereward", lazy("megatron_omni.reward.imagereward:ImageReward"))
register_scorer("vlm_judge", lazy("megatron_omni.reward.vlm_scorers:VlmJudgeScorer"))
register_scorer("unifiedreward", lazy("megatron_omni.reward.vlm_scorers:VlmJudgeScorer"))
register_scorer("geneval", lazy("megatron_omni.reward.vlm_scorers:GenEvalScorer"))
register_scorer("edit_text", lazy("megatron_omni.reward.edit:EditTextScorer"))


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _parse_weighted(spec: str) -> list[tuple[str, float, bool]]:
    terms = []
    for part in spec.split("+"):
        m = _TERM.match(part)
        if not part.strip() or m is None:
            raise RewardInputError(f"cannot parse weighted scorer spec {spec!r} near {part!r}")
        weight = 1.0
        if m.group(1) is not None:
            try:
                weight = float(m.group(1))
            except ValueError as exc:
                raise RewardInputError(f"bad weight {m.group(1)!r} in scorer spec {spec!r}") from exc
        name = m.group(2)
        terms.append((name.removesuffix("?"), weight, not name.endswith("?")))
    return terms


def parse_terms(spec: str) -> list[tuple[str, float, bool]]:
    """(name, weight, required) of each term of a weighted string spec ("0.7*pickscore+0.3*ocr?"); a plain name
    is one required term of weight 1."""
    spec = spec.strip()
    return _parse_weighted(spec) if ("+" in spec or "*" in spec or spec.endswith("?")) else [(spec, 1.0, True)]


def scorer_names(spec: str | Mapping[str, Any]) -> list[str]:
    """The scorer names a spec uses, checked without building anything: each must be registered or a
    'module:function' whose module can be found. RewardInputError naming the first one that is neither."""
    import importlib.util

    if isinstance(spec, Mapping):
        if "weighted" in spec:
            return [n for t in spec["weighted"] for n in scorer_names(t["scorer"] if isinstance(t, Mapping)
                                                                      and "scorer" in t else "")]
        if "name" not in spec:
            raise RewardInputError(f"scorer spec {dict(spec)!r} needs 'name' or 'weighted'")
        return scorer_names(spec["name"])
    if not isinstance(spec, str) or not spec.strip():
        raise RewardInputError(f"scorer spec must be a non-empty string or dict, got {spec!r}")
    spec = spec.strip()
    if "+" in spec or "*" in spec or spec.endswith("?"):
        return [n for name, _, _ in _parse_weighted(spec) for n in scorer_names(name)]
    if ":" in spec:
        module = spec.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise RewardInputError(f"scorer {spec!r}: module {module!r} is not importable")
        return [spec]
    if spec not in _REGISTRY:
        raise RewardInputError(
            f"unknown scorer {spec!r}; registered: {', '.join(available_scorers())}, or 'module:function'"
        )
    return [spec]


def build_scorer(spec: str | Mapping[str, Any], *, device: str | None = None,
                 options: Mapping[str, Mapping[str, Any]] | None = None, **kwargs: Any) -> Scorer:
    """A Scorer from a spec (see the module docstring); `kwargs` are constructor options; `options` maps a
    registered name to its constructor options wherever it appears in the spec (so "0.7*pickscore+0.3*ocr" can
    carry pickscore's weights folder: {"pickscore": {"model": PATH}})."""
    if isinstance(spec, Mapping):
        if "weighted" in spec:
            if kwargs:
                raise RewardInputError("options for a weighted sum go inside each term")
            terms = []
            for t in spec["weighted"]:
                if not isinstance(t, Mapping) or "scorer" not in t:
                    raise RewardInputError(
                        f"weighted term {t!r} needs a 'scorer' key (and optional 'weight')"
                    )
                sub = build_scorer(t["scorer"], device=device, options=options, **dict(t.get("kwargs", {})))
                terms.append((sub, float(t.get("weight", 1.0)), bool(t.get("required", True))))
            return WeightedSum(terms)
        if "name" not in spec:
            raise RewardInputError(f"scorer spec {dict(spec)!r} needs 'name' or 'weighted'")
        kw = {**dict(spec.get("kwargs", {})), **kwargs}
        return build_scorer(spec["name"], device=kw.pop("device", device), options=options, **kw)
    if not isinstance(spec, str) or not spec.strip():
        raise RewardInputError(f"scorer spec must be a non-empty string or dict, got {spec!r}")
    spec = spec.strip()
    if "+" in spec or "*" in spec or spec.endswith("?"):
        if kwargs:
            raise RewardInputError(f"options cannot be given to the weighted spec {spec!r}; use a dict spec or "
                                   "per-name options")
        return WeightedSum([(build_scorer(name, device=device, options=options), w, req)
                            for name, w, req in _parse_weighted(spec)])
    if ":" in spec:
        scorer = import_scorer(spec, device=device, **kwargs)
    elif spec in _REGISTRY:
        factory = _REGISTRY[spec]
        kwargs = {**dict((options or {}).get(spec, {})), **kwargs}
        device = kwargs.pop("device", device)  # a device in the options wins over the server's
        if device is not None and _accepts(factory, "device"):
            kwargs = {**kwargs, "device": device}
        scorer = factory(**kwargs)
    else:
        raise RewardInputError(
            f"unknown scorer {spec!r}; registered: {', '.join(available_scorers())}, or 'module:function'"
        )
    if not isinstance(scorer, Scorer):
        raise RewardInputError(f"scorer {spec!r} built {type(scorer).__name__}, not a Scorer")
    return scorer
