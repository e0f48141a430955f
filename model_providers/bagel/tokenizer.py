"""BAGEL's tokenizer: the Qwen2 tokenizer files a published BAGEL folder ships (`tokenizer.json`,
`tokenizer_config.json`, ...), loaded as vLLM-Omni's `BagelPipeline` loads them (`AutoTokenizer`, local files only,
then its `add_special_tokens`, which gives the bos / eos / start / end of image ids), and a tiny byte-level Qwen2
tokenizer in the same layout for the offline tiny folder.

A text prompt becomes BAGEL's generation prompt `[bos] + tokenizer.encode(text) + [eos]` (BAGEL's
`prepare_prompts`); the trainer adds bos/eos. A prompt made only of whitespace-separated integers is read as token
ids (how the tiny recipe's prompts are written), anything else as text through the folder's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The tiny tokenizer's specials, at the tiny preset's token ids (0 = <|endoftext|>, then bos, eos, start / end of
# image), then the 95 printable ASCII bytes in GPT-2's byte-level alphabet: 100 ids, inside the tiny 128 vocabulary.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_tiny_tokenizer() -> Any:
    """A byte-level `Qwen2Tokenizer` of printable ASCII (no merges) whose specials sit at the tiny preset's ids."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    from model_providers.qwen_image.tiny_pipeline import bytes_to_unicode

    byte_map = bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(TINY_SPECIAL_TOKENS)}
    for b in range(32, 127):
        vocab[byte_map[b]] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=2048, unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in TINY_SPECIAL_TOKENS[1:]]})
    return tok


def has_tokenizer(folder: str | Path) -> bool:
    """Whether a BAGEL folder ships tokenizer files."""
    return any((Path(folder) / f).exists() for f in TOKENIZER_FILES + ("vocab.json",))


def load_tokenizer(folder: str | Path, tokens: dict[str, int]) -> Any:
    """The folder's tokenizer as vLLM-Omni's BAGEL pipeline loads it (AutoTokenizer, local files, then its
    `add_special_tokens`); raises ValueError when its special token ids differ from the config's `new_token_ids`
    (`tokens`), naming them."""
    from transformers import AutoTokenizer
    from vllm_omni.diffusion.models.bagel.pipeline_bagel import add_special_tokens

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok, ids, _ = add_special_tokens(tok)
    if {k: int(v) for k, v in ids.items()} != {k: int(tokens[k]) for k in ids}:
        raise ValueError(f"{folder}: the tokenizer's special token ids {ids} differ from config.json's "
                         f"new_token_ids {tokens}")
    return tok


def is_token_ids(prompt: str) -> bool:
    """Whether a prompt is written as whitespace-separated token ids."""
    ids = prompt.split()
    return bool(ids) and all(t.isdigit() for t in ids)


def encode_prompt(prompt: str, vocab_size: int, tokenizer: Any | None) -> list[int]:
    """A prompt's token ids (without bos / eos): token-id prompts as written, text through `tokenizer` (which must
    give back the text exactly: a character outside its vocabulary is refused, not dropped). Raises ValueError
    naming the prompt."""
    if is_token_ids(prompt):
        ids = [int(t) for t in prompt.split()]
    elif tokenizer is None:
        raise ValueError(f"prompt {prompt!r} is text but the BAGEL folder has no tokenizer (write token ids: "
                         "whitespace-separated integers)")
    else:
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        if not ids or tokenizer.decode(ids) != prompt:
            raise ValueError(f"prompt {prompt!r}: the BAGEL tokenizer does not encode it exactly (got "
                             f"{tokenizer.decode(ids)!r}; a character outside its vocabulary?)")
    if not ids or max(ids) >= vocab_size:
        raise ValueError(f"prompt {prompt!r}: token ids must be in [0, {vocab_size})")
    return ids
