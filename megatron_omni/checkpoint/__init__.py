"""Checkpoints: Megatron distributed checkpoints of the DiT at any layout, streaming diffusers safetensors,
and the diffusers <-> Megatron conversions (`tools/checkpoint/convert.py` is their command line)."""

from megatron_omni.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
