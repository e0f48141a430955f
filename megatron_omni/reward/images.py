"""Image normalisation and the PNG/base64 wire format shared by scorers, server and client."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image

from megatron_omni.reward.errors import RewardInputError

ImageLike = Any  # PIL.Image.Image or a uint8 numpy array of shape (H, W, 3)

# Decompression bombs and typos (a 50k x 50k "image") are refused before they reach a scorer.
MAX_PIXELS = 4096 * 4096


def to_pil_rgb(image: ImageLike) -> Image.Image:
    """Return `image` as an RGB PIL image.

    Accepts a PIL image (modes RGB, RGBA, L, P, ...; alpha is dropped) or a uint8 array of shape
    (H, W, 3). Anything else raises RewardInputError naming what was given.
    """
    if isinstance(image, Image.Image):
        if image.width < 1 or image.height < 1:
            raise RewardInputError(f"empty image of size {image.size}")
        if image.width * image.height > MAX_PIXELS:
            raise RewardInputError(f"image of {image.width}x{image.height} pixels exceeds {MAX_PIXELS}")
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise RewardInputError(f"image array must be uint8, got {image.dtype}")
        if image.ndim != 3 or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
            raise RewardInputError(f"image array must have shape (H, W, 3), got {tuple(image.shape)}")
        if image.shape[0] * image.shape[1] > MAX_PIXELS:
            raise RewardInputError(f"image of shape {tuple(image.shape)} exceeds {MAX_PIXELS} pixels")
        return Image.fromarray(np.ascontiguousarray(image), mode="RGB")
    raise RewardInputError(
        f"image must be a PIL.Image.Image or a uint8 numpy array (H, W, 3), got {type(image).__name__}"
    )


def encode_png(image: ImageLike) -> bytes:
    """PNG bytes of `image` (lossless, so the server scores exactly the pixels the client had)."""
    buf = io.BytesIO()
    # compress_level 1: the wire is localhost or a datacentre network, encode time matters more than bytes.
    to_pil_rgb(image).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def encode_png_b64(image: ImageLike) -> str:
    """Base64 (ASCII) of the PNG encoding of `image`."""
    return base64.b64encode(encode_png(image)).decode("ascii")


def decode_b64(data: Any) -> bytes:
    """Bytes of a base64 string; RewardInputError when it is not a valid base64 string."""
    if not isinstance(data, str) or not data:
        raise RewardInputError(f"'image' must be a non-empty base64 string, got {type(data).__name__}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RewardInputError(f"'image' is not valid base64: {exc}") from exc


def decode_png(data: bytes) -> Image.Image:
    """Decode PNG (or any PIL-readable) bytes to an RGB image; RewardInputError when it is not an image."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise RewardInputError(f"image of {img.width}x{img.height} pixels exceeds {MAX_PIXELS}")
            img.load()
            return to_pil_rgb(img)
    except RewardInputError:
        raise
    except Exception as exc:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError)
        raise RewardInputError(f"'image' is not a decodable image: {type(exc).__name__}: {exc}") from exc
