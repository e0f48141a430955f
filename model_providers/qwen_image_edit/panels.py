"""What an edit run's sample grids show (`DiTTraits.sample_panels`): each sample's source beside its output,
captioned with the instruction."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from model_providers.qwen_image_edit.data import EditRecord


def source_output_panels(prompts: list[str], images: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """Edit prompt strings [N] and outputs [N, 3, H, W] in [0, 1] -> (panels [N, 3, H, 2W]: the source resized to
    H x W, then the output; the instructions [N])."""
    panels, captions = [], []
    height, width = images.shape[-2:]
    for prompt, out in zip(prompts, images, strict=True):
        record = EditRecord.parse(prompt)
        src = record.load_image().resize((width, height), Image.BICUBIC)
        src_t = torch.from_numpy(np.asarray(src, dtype=np.float32) / 255.0).permute(2, 0, 1)
        panels.append(torch.cat([src_t, out.float().cpu()], dim=-1))
        captions.append(record.instruction)
    return torch.stack(panels), captions
