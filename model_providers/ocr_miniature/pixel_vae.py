"""A pixel-space "VAE" for Qwen-Image pipelines: grayscale pixels folded into latent channels, exactly.

`PixelShuffleVAE` stands where `AutoencoderKLQwenImage` stands in a `QwenImagePipeline` (same calls: `encode`
on [N, 3, 1, H, W] images in [-1, 1], `decode` of [N, z, 1, h, w] latents, `config.z_dim`,
`config.latents_mean`/`latents_std`, `temperal_downsample` for the pipeline's scale factor), but it has no
weights: encoding averages the RGB channels and moves each `scale` x `scale` block of pixels into
`scale ** 2` channels (space-to-depth), decoding is the exact inverse with the gray value repeated over RGB.
With scale 4 a 64 px image is a 16 x 16 x 16 latent, which the transformer packs 2 x 2 into 64 tokens of 64
values: an 8 x 8 pixel patch per token, the pixel-space set-up that was measured
learning legible words. A learned VAE's decoder cannot be this map (its nearest-neighbour upsampling
followed by convolutions cannot route each latent channel to one pixel parity), hence this class.

A pipeline folder names it in `model_index.json` as `["model_providers.ocr_miniature.pixel_vae",
"PixelShuffleVAE"]`; diffusers imports that module when it loads the folder.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput, IdentityDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput
from diffusers.models.modeling_utils import ModelMixin

__all__ = ["PixelShuffleVAE", "ModelMixin"]  # diffusers' loader looks up the base class in this module


class PixelShuffleVAE(ModelMixin, ConfigMixin):
    """Exact grayscale space-to-depth "VAE" (see the module docstring).

    Args:
        scale: pixels per latent position along each side (a power of 2).
        z_dim: latent channels; must be scale ** 2.
        latents_mean, latents_std: per-channel statistics of the latents the pipeline normalises with
            (as in Qwen-Image's VAE config); None: 0 and 1.
    """

    _supports_gradient_checkpointing = False

    @register_to_config
    def __init__(self, scale: int = 4, z_dim: int = 16, latents_mean: list[float] | None = None,
                 latents_std: list[float] | None = None) -> None:
        super().__init__()
        if scale < 2 or scale & (scale - 1):
            raise ValueError(f"scale must be a power of 2 (>= 2), got {scale}")
        if z_dim != scale * scale:
            raise ValueError(f"z_dim must be scale ** 2 = {scale * scale}, got {z_dim}")
        for name, stats in (("latents_mean", latents_mean), ("latents_std", latents_std)):
            if stats is not None and len(stats) != z_dim:
                raise ValueError(f"{name} has {len(stats)} values, expected z_dim = {z_dim}")
        if latents_mean is None:
            self.register_to_config(latents_mean=[0.0] * z_dim)
        if latents_std is None:
            self.register_to_config(latents_std=[1.0] * z_dim)
        # QwenImagePipeline's scale factor is 2 ** len(vae.temperal_downsample) (the attribute, not config).
        self.temperal_downsample = [False] * int(math.log2(scale))
        # Relative RGB weights of the gray value, equal (the dataset's ink and background colours are random);
        # sum(w x) / sum(w) keeps a gray image's value exact. A saved buffer also gives ModelMixin its dtype and
        # device and the folder its weights file, which loading needs.
        self.register_buffer("rgb_weights", torch.ones(3))

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> AutoencoderKLOutput | tuple:
        """[N, 3, 1, H, W] RGB in [-1, 1] -> latents [N, z, 1, H / scale, W / scale] (the gray value of each
        pixel, as `latent_dist.mode()`; the distribution is a point)."""
        if x.ndim != 5 or x.shape[1] != 3 or x.shape[2] != 1:
            raise ValueError(f"expected images [N, 3, 1, H, W], got {tuple(x.shape)}")
        s = self.config.scale
        if x.shape[-1] % s or x.shape[-2] % s:
            raise ValueError(f"image size {tuple(x.shape[-2:])} is not a multiple of the scale {s}")
        w = self.rgb_weights.to(x.dtype)
        gray = (torch.einsum("nchw,c->nhw", x[:, :, 0], w) / w.sum()).unsqueeze(1)
        z = F.pixel_unshuffle(gray, s).unsqueeze(2)
        dist = IdentityDistribution(z)
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        """Latents [N, z, 1, h, w] -> RGB [N, 3, 1, h * scale, w * scale] in [-1, 1] (clamped, like Qwen-Image's
        decoder)."""
        if z.ndim != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(f"expected latents [N, {self.config.z_dim}, T, h, w], got {tuple(z.shape)}")
        frames = [F.pixel_shuffle(z[:, :, t], self.config.scale) for t in range(z.shape[2])]
        image = torch.stack(frames, dim=2).expand(-1, 3, -1, -1, -1).clamp(-1.0, 1.0)
        return DecoderOutput(sample=image) if return_dict else (image,)
