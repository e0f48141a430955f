"""megatron-omni: Megatron-Core-native RL post-training for diffusion transformers and AR-DiT models."""

__version__ = "0.1.0"
