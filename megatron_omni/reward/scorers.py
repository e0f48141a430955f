"""The scorer interface and the rule rewards: DDPO's JPEG (in)compressibility, weighted sums, user scorers.

A scorer maps a batch of images with their prompts and per-sample metadata to one float per image:

    scorer(images, prompts, metadata) -> list[float]      # len == len(images)

`images` are PIL images or uint8 arrays (H, W, 3); `metadata` is a list of JSON-like dicts (or None).
`Scorer.__call__` normalises and checks the inputs and the outputs; subclasses implement `score`, which
receives RGB PIL images only. Failures raise (see errors.py); no scorer returns a default value.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from PIL import Image

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.images import ImageLike, to_pil_rgb


class Scorer(abc.ABC):
    """Base class: checks inputs/outputs around `score`."""

    name: str = "scorer"

    def __call__(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[float]:
        """Rewards of `images` (N of them) as N Python floats, in input order."""
        n = len(images)
        if len(prompts) != n:
            raise RewardInputError(f"{self.name}: {n} images but {len(prompts)} prompts")
        if metadata is None:
            metadata = [{}] * n
        if len(metadata) != n:
            raise RewardInputError(f"{self.name}: {n} images but {len(metadata)} metadata entries")
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise RewardInputError(f"{self.name}: prompt {i} must be a string, got {type(p).__name__}")
        pil = [to_pil_rgb(im) for im in images]
        meta = [dict(m) if m else {} for m in metadata]
        if n == 0:
            return []
        return check_rewards(self.name, self.score(pil, list(prompts), meta), n)

    @abc.abstractmethod
    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Rewards of N RGB images; implemented by each scorer."""

    def warmup(self) -> None:  # noqa: B027 (optional hook)
        """Run once before serving so the first request does not pay for lazy initialisation."""

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract: most scorers hold nothing)
        """Release resources (sessions, engines). Default: nothing to release."""


def check_rewards(name: str, rewards: Any, n: int) -> list[float]:
    """`rewards` as a list of n finite floats; RewardScorerError naming `name` otherwise."""
    try:
        values = [float(r) for r in rewards]
    except (TypeError, ValueError) as exc:
        raise RewardScorerError(f"{name} returned non-numeric rewards: {exc}") from exc
    if len(values) != n:
        raise RewardScorerError(f"{name} returned {len(values)} rewards for {n} images")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardScorerError(f"{name} returned non-finite rewards at positions {bad[:8]}")
    return values


def jpeg_size_kb(image: Image.Image, quality: int = 95) -> float:
    """Size of `image` encoded as JPEG at `quality`, in kB (1000 bytes), as DDPO measures it."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class JpegCompressibility(Scorer):
    """DDPO's `jpeg_compressibility`: minus the JPEG size in kB (smaller files score higher)."""

    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95):
        self.quality = int(quality)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """-size_kb per image."""
        return [-jpeg_size_kb(im, self.quality) for im in images]


class JpegIncompressibility(Scorer):
    """DDPO's `jpeg_incompressibility`: the JPEG size in kB (larger files score higher)."""

    name = "jpeg_incompressibility"

    def __init__(self, quality: int = 95):
        self.quality = int(quality)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """size_kb per image."""
        return [jpeg_size_kb(im, self.quality) for im in images]


class WeightedSum(Scorer):
    """sum_k w_k * scorer_k(images); every term is computed on the same batch.

    A term is required (default) or optional: a required term that fails raises, an optional one that fails
    is left out of the sum and reported by `term_scores` (the trainer then leaves it out of the whole step).
    Term names are the scorers' names (a repeated name gets '#2', '#3', ...).
    """

    name = "weighted"

    def __init__(self, terms: Sequence[tuple[Scorer, float] | tuple[Scorer, float, bool]]):
        if not terms:
            raise RewardInputError("a weighted sum needs at least one (scorer, weight) term")
        self.terms: list[tuple[Scorer, float]] = []
        self.required: dict[str, bool] = {}
        self.weights: dict[str, float] = {}
        self.term_names: list[str] = []
        for t in terms:
            s, w, req = (*t, True) if len(t) == 2 else t
            if not isinstance(s, Scorer):
                raise RewardInputError(f"weighted sum term {s!r} is not a Scorer")
            if not math.isfinite(float(w)):
                raise RewardInputError(f"weighted sum weight {w!r} is not finite")
            name, k = s.name, 2
            while name in self.weights:
                name, k = f"{s.name}#{k}", k + 1
            self.terms.append((s, float(w)))
            self.term_names.append(name)
            self.weights[name], self.required[name] = float(w), bool(req)
        self.name = "+".join(f"{w:g}*{s.name}{'' if self.required[n] else '?'}"
                             for (s, w), n in zip(self.terms, self.term_names))

    def term_scores(self, images: list[Image.Image], prompts: list[str],
                    metadata: list[dict]) -> tuple[dict[str, list[float]], dict[str, str]]:
        """({term: N rewards} of the terms that scored, {term: error message} of the optional terms that failed).
        A failing required term raises; so does bad input (RewardInputError), whichever term meets it."""
        values: dict[str, list[float]] = {}
        failed: dict[str, str] = {}
        for (s, _), name in zip(self.terms, self.term_names):
            try:
                values[name] = s(images, prompts, metadata)
            except RewardInputError:
                raise
            except Exception as exc:
                if self.required[name]:
                    raise
                failed[name] = f"{type(exc).__name__}: {exc}"
        return values, failed

    def combine(self, values: Mapping[str, Sequence[float]], n: int) -> list[float]:
        """sum_k w_k * values[k] over the terms present in `values` (failed optional terms are absent)."""
        total = [0.0] * n
        for name, v in values.items():
            for i, r in enumerate(v):
                total[i] += self.weights[name] * r
        return total

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Weighted sum of the terms' rewards (failed optional terms left out)."""
        values, _ = self.term_scores(images, prompts, metadata)
        return self.combine(values, len(images))

    def warmup(self) -> None:
        """Warm up every term."""
        for s, _ in self.terms:
            s.warmup()

    def close(self) -> None:
        """Close every term."""
        for s, _ in self.terms:
            s.close()


class FunctionScorer(Scorer):
    """Wraps a user function `fn(images, prompts, metadata) -> sequence of floats` as a Scorer."""

    def __init__(self, fn: Callable[..., Any], name: str):
        self.fn = fn
        self.name = name

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Calls the user function; its output is checked by Scorer.__call__."""
        return self.fn(images, prompts, metadata)


def import_scorer(path: str, *, device: str | None = None, **kwargs: Any) -> Scorer:
    """A user scorer given as "package.module:attr".

    `attr` may be a Scorer subclass or any class/factory returning a Scorer (called with `kwargs`, plus
    `device` when its constructor takes one), or a plain function `fn(images, prompts, metadata) -> floats`
    (then `kwargs` must be empty).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RewardInputError(f"user scorer must be given as 'module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardInputError(
            f"cannot import module {module_name!r} of user scorer {path!r}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardInputError(f"module {module_name!r} has no attribute {attr!r} (user scorer {path!r})")
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        if device is not None and "device" in inspect.signature(obj).parameters:
            kwargs = {**kwargs, "device": device}
        inst = obj(**kwargs)
        if isinstance(inst, Scorer):
            return inst
        if callable(inst):
            return FunctionScorer(inst, name=path)
        raise RewardInputError(f"user scorer {path!r} built a non-callable {type(inst).__name__}")
    if not callable(obj):
        raise RewardInputError(f"user scorer {path!r} is not callable")
    if kwargs:
        built = obj(**kwargs)  # a factory taking options
        if isinstance(built, Scorer):
            return built
        if callable(built):
            return FunctionScorer(built, name=path)
        raise RewardInputError(f"user scorer factory {path!r} returned a non-callable {type(built).__name__}")
    return FunctionScorer(obj, name=path)
