"""Autoregressive pieces of AR-DiT hybrids: the GPT decoder wrapper, the connector, the hybrid model."""
