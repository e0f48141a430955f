"""AR-DiT: a Qwen2-style Megatron-Core GPT decoder whose hidden states condition the Qwen-Image MMDiT."""
