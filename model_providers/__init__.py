"""Model providers: one folder per model family (presets, Megatron-Core construction, weight layouts), each
with a `family.py` bundle looked up by name (`get_family`)."""

from model_providers.registry import DiTTraits, ModelFamily, family_names, get_family

__all__ = ["DiTTraits", "ModelFamily", "family_names", "get_family"]
