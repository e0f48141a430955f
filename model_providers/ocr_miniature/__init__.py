"""The OCR miniature: a Qwen-Image-shaped tiny model that learns to render words, for RL experiments on 2 CPU
cores. Its synthetic word dataset and glyph renderer (`text_dataset`), its architecture preset
(`text_miniature`, a Qwen-Image family preset) and its optional pixel-shuffle VAE (`pixel_vae`) live here,
not in the Qwen-Image family, whose model they only configure."""
