"""The OCR reward: similarity between the text a prompt asks for and the text a reader finds in the image.

Two readers share the `TextReader` interface (`read(images) -> list[str]`):
- `RapidOcrReader`: rapidocr 3.10.0 (PP-OCR det+rec ONNX models shipped in its wheel), tuned for small
  images as the environment notes say: detection resizes so the short side is >= 160 px instead of
  upscaling everything to 736 px, no angle classifier, one onnxruntime thread per reader.
- `VlmJudgeReader` (vlm_judge.py): a VLM behind an OpenAI-compatible chat API asked to transcribe.

Reward per image (flow_grpo / VeRL-Omni): `1 - min(lev(read, target), len(target)) / len(target)` on
lower-cased, space-free texts, 1 when the target is contained in the read text (see text.ocr_similarity).
That reward is a step function of the image (a word is read or missed); `RapidOcrReader.legibility` is the
same recognizer's continuous measure of how legible the target is (for benchmarks that compare two samplers).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.scorers import Scorer
from megatron_omni.reward.text import normalize_text, ocr_similarity, resolve_target


class TextReader(Protocol):
    """Reads the text in each image; '' when there is none."""

    name: str

    def read(self, images: list[Image.Image]) -> list[str]:
        """One string per RGB image, in order."""
        ...

    def close(self) -> None:
        """Release resources."""
        ...


def _split_device(device: str | None) -> tuple[str, int]:
    """('cpu', 0) for None/'cpu'; (type, index) for 'type:index' strings handed over by the server CLI."""
    if device is None or device == "cpu":
        return "cpu", 0
    kind, _, idx = device.partition(":")
    try:
        return kind, int(idx) if idx else 0
    except ValueError as exc:
        raise RewardInputError(f"device {device!r} is not of the form 'type' or 'type:index'") from exc


# The onnxruntime execution provider rapidocr's accelerator path (EngineConfig.onnxruntime.use_cuda) needs.
ACCELERATOR_PROVIDER = "CUDAExecutionProvider"


def missing_accelerator(device: str | None) -> str | None:
    """Why OCR cannot run on `device` ('type:index'): onnxruntime lacks the accelerator provider (the message
    names the provider list); None when it can (or `device` is the CPU). Without this check onnxruntime falls
    back to the CPU with a warning rapidocr hides."""
    kind, _ = _split_device(device)
    if kind == "cpu":
        return None
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    if ACCELERATOR_PROVIDER in providers:
        return None
    return (f"OCR on {device!r} needs onnxruntime's {ACCELERATOR_PROVIDER}, but onnxruntime "
            f"{onnxruntime.__version__} has only {providers} (install onnxruntime-gpu, as the GPU image does, or "
            "give the reward server --allow-cpu-fallback to score on the CPU)")


class RapidOcrReader:
    """rapidocr's PP-OCR pipeline (detection + recognition), on CPU or an accelerator given by `device`."""

    name = "rapidocr"

    def __init__(
        self,
        *,
        limit_side_len: int = 160,
        threads: int = 1,
        device: str | None = None,
        text_score: float = 0.5,
    ):
        from rapidocr import RapidOCR  # heavy import (onnxruntime, cv2): only where a reader is built

        kind, index = _split_device(device)
        missing = missing_accelerator(device)
        if missing is not None:
            raise RewardInputError(missing)
        params: dict[str, Any] = {
            "Det.limit_type": "min",
            "Det.limit_side_len": int(limit_side_len),
            "Global.use_cls": False,
            "Global.text_score": float(text_score),
            "Global.log_level": "error",
            "EngineConfig.onnxruntime.intra_op_num_threads": int(threads),
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
        if kind != "cpu":
            # onnxruntime's accelerator execution provider; the shipped models and languages stay the
            # defaults (any other choice makes rapidocr try to download).
            params["EngineConfig.onnxruntime.use_cuda"] = True
            params["EngineConfig.onnxruntime.cuda_ep_cfg.device_id"] = index
        try:
            self.engine = RapidOCR(params=params)
        except Exception as exc:
            raise RewardScorerError(
                f"could not build the rapidocr engine: {type(exc).__name__}: {exc}"
            ) from exc

    def read(self, images: list[Image.Image]) -> list[str]:
        """Concatenated recognised lines per image (reading order of rapidocr), '' when none."""
        out = []
        for im in images:
            # rapidocr treats arrays as BGR (OpenCV order); PIL images are RGB.
            bgr = np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1])
            try:
                result = self.engine(bgr)
            except Exception as exc:
                raise RewardScorerError(
                    f"rapidocr failed on a {im.size} image: {type(exc).__name__}: {exc}"
                ) from exc
            txts = getattr(result, "txts", None)
            out.append("".join(txts) if txts else "")
        return out

    def legibility(self, images: list[Image.Image], targets: list[str]) -> list[float]:
        """Per image, the recognizer's per-character geometric-mean probability of its target,
        exp(log P(target | image) / len(target)) in [0, 1], a continuous measure of legibility.

        P is the CTC likelihood under PP-OCR's recognition model (rapidocr's own pre-processing and ONNX
        session) of the target's lower-cased, space-free text, case-insensitively (each letter's probability is
        its lower- plus upper-case entry's), on each text box detection finds (the best box counts), else on the
        whole image resized as the recognizer resizes its inputs."""
        from rapidocr.utils.log import logger

        if len(images) != len(targets):
            raise RewardInputError(f"{len(images)} images but {len(targets)} targets")
        rec = self.engine._load_rec_model()
        out = []
        for im, target in zip(images, targets):
            text = normalize_text(target)
            if not text:
                raise RewardInputError(f"empty OCR target {target!r}")
            bgr = np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1])
            img, record = self.engine.preprocess_img(self.engine.load_img(bgr))
            crops: list[np.ndarray] = []
            level = logger.level
            logger.setLevel("CRITICAL")  # "The text detection result is empty": an expected outcome here
            try:
                crops, _ = self.engine.detect_and_crop(img, record)
            except Exception as exc:  # rapidocr raises its RapidOCRError when no box is found
                if "empty" not in str(exc):
                    raise RewardScorerError(f"rapidocr detection failed on a {im.size} image: {exc}") from exc
            finally:
                logger.setLevel(level)
            crops = crops or [img]
            _, height, width = rec.rec_image_shape
            best = -float("inf")
            for crop in crops:
                wh = max(width / height, crop.shape[1] / crop.shape[0])
                probs = rec.session(rec.resize_norm_img(crop, wh)[np.newaxis].astype(np.float32))  # (1, T, C)
                best = max(best, ctc_log_likelihood(probs[0], text, rec.postprocess_op.dict))
            out.append(float(np.exp(best / len(text))))
        return out

    def warmup(self) -> None:
        """One read of a small synthetic image (onnxruntime's first run allocates and optimises)."""
        img = Image.new("RGB", (96, 48), "white")
        ImageDraw.Draw(img).text((8, 12), "WARM", fill="black", font=ImageFont.load_default(size=20))
        self.read([img])

    def close(self) -> None:
        """Nothing to release (sessions are freed with the object)."""


def ctc_log_likelihood(probs: np.ndarray, text: str, index: dict[str, int]) -> float:
    """log P(text) under a CTC recognizer's per-timestep character probabilities `probs` [T, C] (class 0 the
    blank, `index` the character -> class map), case-insensitive: a letter's class is its lower- plus upper-case
    entry. The distribution is reduced to [blank, each distinct character of `text`, everything else] (still
    summing to 1) before torch's CTC loss; -inf when `text` cannot be aligned in T steps or has a character
    the dictionary lacks."""
    import torch

    chars = sorted(set(text))
    cols = [probs[:, 0]]
    for c in chars:
        ids = {index[v] for v in (c, c.lower(), c.upper()) if v in index}
        if not ids:
            return -float("inf")
        cols.append(probs[:, sorted(ids)].sum(axis=1))
    cols.append(np.clip(1.0 - np.sum(cols, axis=0), 0.0, None))
    logp = torch.from_numpy(np.log(np.clip(np.stack(cols, axis=1), 1e-30, None)).astype(np.float64))
    target = torch.tensor([[1 + chars.index(c) for c in text]])
    nll = torch.nn.functional.ctc_loss(logp[:, None, :], target, torch.tensor([logp.shape[0]]),
                                       torch.tensor([len(text)]), blank=0, reduction="sum", zero_infinity=False)
    return -float(nll)


def build_reader(reader: str | TextReader, **kwargs: Any) -> TextReader:
    """A reader from its name ('rapidocr' or 'vlm') and options, or the reader object itself."""
    if not isinstance(reader, str):
        if kwargs:
            raise RewardInputError("reader options are only accepted with a reader name")
        return reader
    if reader == "rapidocr":
        return RapidOcrReader(**kwargs)
    if reader in ("vlm", "vlm_judge"):
        from megatron_omni.reward.vlm_judge import VlmJudgeReader

        return VlmJudgeReader(**kwargs)
    raise RewardInputError(f"unknown OCR reader {reader!r}; choose 'rapidocr' or 'vlm'")


class OcrScorer(Scorer):
    """OCR similarity reward. The target is metadata['target'] if given, else the prompt's quoted text."""

    def __init__(self, reader: str | TextReader = "rapidocr", **reader_kwargs: Any):
        self.reader = build_reader(reader, **reader_kwargs)
        self.name = "ocr" if self.reader.name == "rapidocr" else f"ocr[{self.reader.name}]"

    def read(self, images: list[Image.Image]) -> list[str]:
        """The raw texts the reader finds (for logging and debugging)."""
        return self.reader.read(images)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Similarity in [0, 1] per image."""
        # Targets first: a prompt without a target is the caller's error and must not cost an OCR pass.
        targets = [resolve_target(p, m) for p, m in zip(prompts, metadata)]
        reads = self.reader.read(images)
        if len(reads) != len(images):
            raise RewardScorerError(
                f"reader {self.reader.name} returned {len(reads)} texts for {len(images)}"
            )
        return [ocr_similarity(r, t) for r, t in zip(reads, targets)]

    def warmup(self) -> None:
        """Warm the reader up if it has such a hook (a remote judge is not called before real work)."""
        hook = getattr(self.reader, "warmup", None)
        if hook is not None:
            hook()

    def close(self) -> None:
        """Close the reader."""
        self.reader.close()
