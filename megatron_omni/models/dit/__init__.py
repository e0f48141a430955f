"""MMDiT building blocks (dual-stream joint attention, adaLN, 3D RoPE), sequence-first `[s, b, h]` inside."""
