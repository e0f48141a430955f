"""Video rewards and video files: a video travels as a strip of sampled frames (pixel-exact through PNG), the
text-in-video OCR reward reads the target in every frame (real rapidocr), the temporal-consistency term is 1
for a still video and falls with flicker, both combine by the registry's weighted-sum syntax, bad metadata is
refused by name; rollout videos are written as a captioned grid GIF or MP4 that reads back."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.images import decode_png, encode_png
from megatron_omni.reward.registry import available_scorers, build_scorer
from megatron_omni.reward.video import TemporalConsistency, sample_frame_indices, strip_frames, video_strip
from megatron_omni.rollout.video_files import grid_frames, save_video, save_video_grid


def text_video(text: str | None, frames: int = 5, seed: int = 0) -> np.ndarray:
    """uint8 [F, 96, 160, 3]: `text` drawn a few pixels further right in every frame (None: noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(frames):
        if text is None:
            out.append(rng.integers(0, 256, (96, 160, 3), dtype=np.uint8))
            continue
        img = Image.new("RGB", (160, 96), "white")
        font = ImageFont.truetype("DejaVuSans-Bold.ttf", 24)
        ImageDraw.Draw(img).text((10 + 2 * t, 30), text, fill="black", font=font)
        out.append(np.asarray(img))
    return np.stack(out)


def test_a_video_crosses_as_a_strip_of_its_sampled_frames() -> None:
    assert sample_frame_indices(9, 3) == [0, 4, 8] and sample_frame_indices(2, 5) == [0, 1]
    video = torch.rand(9, 3, 8, 6)
    strip, meta = video_strip(video, 3)
    assert meta == {"frames": 3} and strip.size == (18, 8)
    back = strip_frames(decode_png(encode_png(strip)), meta)  # PNG on the wire: every pixel kept
    want = (video[[0, 4, 8]].clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy()
    assert all(np.array_equal(np.asarray(f), w) for f, w in zip(back, want))
    with pytest.raises(RewardInputError, match="metadata\\['frames'\\]"):
        strip_frames(strip, {})
    with pytest.raises(RewardInputError, match="does not hold 4 frames"):
        strip_frames(strip, {"frames": 4})


def test_video_ocr_reads_the_target_in_every_frame() -> None:
    scorer = build_scorer("video_ocr")
    legible = video_strip(text_video("OPEN"), 3)
    noise = video_strip(text_video(None), 3)
    half = np.concatenate([text_video("OPEN", 2), text_video(None, 2)])  # text in 2 of 4 sampled frames
    half_strip = video_strip(half, 4)
    rewards = scorer([legible[0], noise[0], half_strip[0]], ['a sign "OPEN"'] * 3,
                     [legible[1], noise[1], half_strip[1]])
    assert rewards[0] >= 0.95 and rewards[1] == 0.0 and 0.4 <= rewards[2] <= 0.6, rewards


def test_temporal_consistency_and_the_weighted_sum() -> None:
    still = np.repeat(text_video("OPEN", 1), 4, axis=0)
    flicker = np.stack([np.zeros((8, 8, 3), np.uint8), np.full((8, 8, 3), 255, np.uint8)] * 2)
    tc = TemporalConsistency()
    strips = [video_strip(v, 4) for v in (still, flicker, text_video(None, 4), text_video("OPEN", 4))]
    r = tc([s for s, _ in strips], ["x"] * 4, [m for _, m in strips])
    assert r[0] == 1.0 and r[1] == 0.0 and 0.5 < r[2] < 0.8 and 0.9 < r[3] < 1.0, r
    assert {"video_ocr", "temporal_consistency"} <= set(available_scorers())
    both = build_scorer("video_ocr+0.5*temporal_consistency")
    ocr = build_scorer("video_ocr")([strips[0][0]], ['"OPEN"'], [strips[0][1]])[0]
    assert both([strips[0][0]], ['"OPEN"'], [strips[0][1]]) == [ocr + 0.5 * r[0]]


def test_rollout_videos_are_written_as_gif_and_mp4(tmp_path: Path) -> None:
    videos = torch.rand(3, 4, 3, 16, 12)
    frames = grid_frames(videos, ["a", "b", "a long caption that is cut"], columns=2)
    assert len(frames) == 4 and frames[0].size == (24, 2 * (16 + 12))
    save_video_grid(videos, ["a", "b", "c"], tmp_path / "grid.gif", fps=4, columns=2)
    with Image.open(tmp_path / "grid.gif") as gif:
        assert gif.n_frames == 4 and gif.size == (24, 56)
    save_video(frames, tmp_path / "grid.mp4", fps=4)
    with av.open(str(tmp_path / "grid.mp4")) as mp4:
        decoded = [f.to_ndarray(format="rgb24") for f in mp4.decode(video=0)]
    assert len(decoded) == 4 and decoded[0].shape == (56, 24, 3)  # even sides as written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.gif", "grid.mp4"]  # no temporary left
    with pytest.raises(ValueError, match="must end in"):
        save_video(frames, tmp_path / "grid.avi")
