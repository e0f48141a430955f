"""Qwen-Image-Edit (the Qwen-Image MMDiT conditioned on source images): see docs/families-qwen-image-edit.md."""
