"""The Qwen2.5-VL processor of an edit pipeline (tokenizer + image processor: what reads image + instruction).

transformers' `Qwen2VLProcessor` insists on a video processor, and its only one (`Qwen2VLVideoProcessor`) needs
torchvision, which does not import beside the CPU torch. The edit pipeline never passes videos, so
`ImageOnlyQwen2VLProcessor` accepts transformers' base video processor in that slot; images and text go
through transformers' own code (the PIL image processor, the same patching and resizing as the torchvision
one). A folder keeps the standard layout (`processor/` with `processor_config.json` and the tokenizer files,
`["transformers", "Qwen2VLProcessor"]` in model_index.json), so a real Qwen-Image-Edit folder loads the same way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import Qwen2VLProcessor


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` for images and text only (see the module docstring)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        from transformers.video_processing_utils import BaseVideoProcessor

        if argument_name == "video_processor":
            if not isinstance(argument, BaseVideoProcessor):
                raise TypeError(f"video_processor must be a BaseVideoProcessor, got {type(argument).__name__}")
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def build_processor(tokenizer, min_pixels: int, max_pixels: int, patch_size: int = 14, merge_size: int = 2,
                    temporal_patch_size: int = 2) -> ImageOnlyQwen2VLProcessor:
    """A processor over `tokenizer` whose image processor resizes into [min_pixels, max_pixels] (multiples of
    patch_size * merge_size), matching a vision tower of that patch, merge and temporal patch size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    image = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                                     merge_size=merge_size, temporal_patch_size=temporal_patch_size)
    return ImageOnlyQwen2VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=BaseVideoProcessor())


def load_processor(folder: str | os.PathLike) -> ImageOnlyQwen2VLProcessor:
    """The processor saved in a pipeline folder's `processor/` subfolder (tokenizer files + processor_config.json)."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    path = Path(folder) / "processor"
    if not (path / "processor_config.json").is_file() and not (path / "preprocessor_config.json").is_file():
        raise FileNotFoundError(f"{path}: no Qwen2-VL processor (processor_config.json or preprocessor_config.json)")
    return ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
                                     tokenizer=Qwen2Tokenizer.from_pretrained(path),
                                     video_processor=BaseVideoProcessor())


def standardise_folder(folder: Path) -> None:
    """Name transformers' `Qwen2VLProcessor` in a saved folder (model_index.json and the processor's config), as
    a published folder does, instead of the subclass that wrote it."""
    index = folder / "model_index.json"
    data = json.loads(index.read_text())
    data["processor"] = ["transformers", "Qwen2VLProcessor"]
    index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    config = folder / "processor" / "processor_config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        cfg["processor_class"] = "Qwen2VLProcessor"
        config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
