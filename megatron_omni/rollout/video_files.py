"""Videos of a rollout as files people look at: a captioned grid of N videos, frame by frame, written as an
animated GIF (Pillow) or an MP4 (H.264 through PyAV), the video counterpart of the trainer's PNG sample grids.

Writes are whole-or-nothing: the file is built under a temporary name beside the target and renamed over it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

SUFFIXES = (".gif", ".mp4")
CAPTION_PX = 12  # the caption band above each tile


def _uint8_frames(video: torch.Tensor) -> np.ndarray:
    """[F, 3, H, W] float in [0, 1] -> uint8 [F, H, W, 3]."""
    return video.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def grid_frames(videos: torch.Tensor, captions: list[str], columns: int = 4) -> list[Image.Image]:
    """N videos [N, F, 3, H, W] in [0, 1] -> F grid images (RGB), tile i showing video i's frame t under its
    caption (cut to the tile's width)."""
    if videos.dim() != 5 or videos.shape[2] != 3:
        raise ValueError(f"videos must be [N, F, 3, H, W], got {tuple(videos.shape)}")
    n, f, _, h, w = videos.shape
    if len(captions) != n:
        raise ValueError(f"{n} videos but {len(captions)} captions")
    cols = min(columns, n)
    rows = -(-n // cols)
    tile_h = h + CAPTION_PX
    font = ImageFont.load_default(size=10)
    base = Image.new("RGB", (cols * w, rows * tile_h), "white")
    draw = ImageDraw.Draw(base)
    for i, caption in enumerate(captions):
        text = caption
        while text and draw.textlength(text, font=font) > w - 2:
            text = text[:-1]
        draw.text(((i % cols) * w + 1, (i // cols) * tile_h), text, fill="black", font=font)
    pixels = [_uint8_frames(v) for v in videos]
    out = []
    for t in range(f):
        frame = base.copy()
        for i in range(n):
            frame.paste(Image.fromarray(pixels[i][t]), ((i % cols) * w, (i // cols) * tile_h + CAPTION_PX))
        out.append(frame)
    return out


def _write_gif(frames: list[Image.Image], path: Path, fps: float) -> None:
    frames[0].save(path, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)


def _write_mp4(frames: list[Image.Image], path: Path, fps: float) -> None:
    import av  # PyAV: only when an MP4 is asked for

    w, h = frames[0].size
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        # yuv420p halves the chroma planes: the encoder needs even sides (pad by one white row/column)
        stream.width, stream.height, stream.pix_fmt = w + w % 2, h + h % 2, "yuv420p"
        for im in frames:
            if (w % 2, h % 2) != (0, 0):
                padded = Image.new("RGB", (stream.width, stream.height), "white")
                padded.paste(im, (0, 0))
                im = padded
            for packet in stream.encode(av.VideoFrame.from_image(im)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def save_video(frames: list[Image.Image], path: str | os.PathLike, fps: float = 8.0) -> None:
    """Write equally sized RGB frames to `path` (.gif or .mp4, by its suffix), atomically."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"video path {path} must end in one of {SUFFIXES}")
    if not frames:
        raise ValueError("no frames to write")
    if len({im.size for im in frames}) != 1:
        raise ValueError(f"frames differ in size: {sorted({im.size for im in frames})}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        (_write_gif if path.suffix == ".gif" else _write_mp4)(frames, tmp, fps)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_video_grid(videos: torch.Tensor, captions: list[str], path: str | os.PathLike, fps: float = 8.0,
                    columns: int = 4) -> None:
    """N videos [N, F, 3, H, W] in [0, 1] with one caption each -> a captioned grid video (.gif or .mp4) at
    `path`, atomically: what the run folder shows beside its PNG grids."""
    save_video(grid_frames(videos, captions, columns), path, fps)
