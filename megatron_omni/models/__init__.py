"""Megatron-Core modules for generation models (DiT building blocks); process groups come in as arguments."""
