"""Video rewards on CPU: text-in-video OCR on sampled frames and a temporal-consistency term between frames.

A video crosses the reward server as one image: K frames sampled evenly over its length, side by side in one
PNG strip (`video_strip`), with metadata `{"frames": K}`. The server's wire, queue and micro-batching stay as
they are for images, PNG keeps every pixel, and any scorer can still read the strip as one image. The video
scorers split the strip back into its frames (`strip_frames`):

- `video_ocr`: the OCR similarity of the prompt's target text (the image OCR reward's: metadata['target'] or
  the prompt's quoted text) in each frame, averaged over the frames: text that is legible in every frame.
- `temporal_consistency`: `1 - mean |f_{k+1} - f_k|` over consecutive sampled frames, pixels in [0, 1]: 1
  for a still video, lower the more the frames jump (flicker, cuts, noise).

Combine them like any scorers: `--scorer "video_ocr+0.5*temporal_consistency"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.scorers import Scorer

FRAMES_KEY = "frames"


def sample_frame_indices(num_frames: int, k: int) -> list[int]:
    """K frame indices spread evenly over `num_frames` (first and last included when k > 1)."""
    if num_frames < 1 or k < 1:
        raise RewardInputError(f"need num_frames >= 1 and k >= 1, got {num_frames} and {k}")
    k = min(k, num_frames)
    if k == 1:
        return [0]
    return [round(i * (num_frames - 1) / (k - 1)) for i in range(k)]


def video_strip(video: Any, k: int) -> tuple[Image.Image, dict[str, int]]:
    """A video as the one image the reward server scores: K evenly sampled frames side by side, and the
    metadata that says so.

    Args:
        video: a torch tensor of frames [F, 3, H, W] float in [0, 1] (a rollout's sample), or a uint8 numpy
            array [F, H, W, 3].
        k: frames to sample (at most F).

    Returns:
        (RGB strip of width K * W, {"frames": K}).
    """
    if not isinstance(video, np.ndarray):  # a torch tensor (the reward room does not import torch)
        if video.dim() != 4 or video.shape[1] != 3:
            raise RewardInputError(f"video tensor must be [F, 3, H, W], got {tuple(video.shape)}")
        frames = video.detach().float().clamp(0, 1).mul(255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    else:
        frames = video
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise RewardInputError(f"video array must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    picked = frames[sample_frame_indices(frames.shape[0], k)]
    return Image.fromarray(np.concatenate(list(picked), axis=1), mode="RGB"), {FRAMES_KEY: len(picked)}


def strip_frames(image: Image.Image, metadata: Mapping[str, Any]) -> list[Image.Image]:
    """The frames of a `video_strip` image; RewardInputError when the metadata does not describe it."""
    k = metadata.get(FRAMES_KEY)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise RewardInputError(f"a video reward needs metadata['{FRAMES_KEY}'] (frames in the strip), got {k!r}")
    if image.width % k:
        raise RewardInputError(f"a strip {image.width} px wide does not hold {k} frames of equal width")
    w = image.width // k
    return [image.crop((i * w, 0, (i + 1) * w, image.height)) for i in range(k)]


class VideoOcrScorer(Scorer):
    """OCR similarity of the target text, averaged over the sampled frames of each video strip (the reader and
    target rules are the image OCR reward's: `ocr.OcrScorer`)."""

    name = "video_ocr"

    def __init__(self, reader: Any = "rapidocr", **reader_kwargs: Any):
        from megatron_omni.reward.ocr import OcrScorer  # rapidocr/onnxruntime load only when asked for

        self.ocr = OcrScorer(reader, **reader_kwargs)

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Mean over each video's frames of the frame's OCR similarity, in [0, 1]."""
        videos = [strip_frames(im, m) for im, m in zip(images, metadata)]
        frames = [f for v in videos for f in v]
        frame_prompts = [p for p, v in zip(prompts, videos) for _ in v]
        frame_meta = [m for m, v in zip(metadata, videos) for _ in v]
        per_frame = self.ocr(frames, frame_prompts, frame_meta)  # one OCR pass over every frame of the batch
        out, at = [], 0
        for v in videos:
            out.append(float(np.mean(per_frame[at:at + len(v)])))
            at += len(v)
        if at != len(per_frame):
            raise RewardScorerError(f"video_ocr: {len(per_frame)} frame rewards for {at} frames")
        return out

    def warmup(self) -> None:
        self.ocr.warmup()

    def close(self) -> None:
        self.ocr.close()


class TemporalConsistency(Scorer):
    """`1 - mean |f_{k+1} - f_k|` over consecutive sampled frames (pixels in [0, 1]); 1 for one frame."""

    name = "temporal_consistency"

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        """Per video strip, in [0, 1]."""
        out = []
        for im, m in zip(images, metadata):
            frames = np.stack([np.asarray(f, dtype=np.float32) / 255.0 for f in strip_frames(im, m)])
            out.append(1.0 - float(np.abs(np.diff(frames, axis=0)).mean()) if len(frames) > 1 else 1.0)
        return out


# The scorers that read a frame strip (a video family's samples); an image has no frames to split.
VIDEO_SCORERS = (VideoOcrScorer.name, TemporalConsistency.name)
