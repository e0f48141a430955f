"""The OCR miniature's data side: rendered words the OCR reader reads back (the reward is attainable),
reproducible from the seed, and a tokenizer whose template prefix is exactly the 34 tokens the pipeline drops."""

from __future__ import annotations

import numpy as np
import pytest

from model_providers.ocr_miniature.text_dataset import (
    HELD_OUT_WORDS,
    RL_WORDS,
    VOCABULARY,
    TextLayout,
    images_to_tensor,
    prompt_for,
    render_dataset,
    render_word,
)


@pytest.fixture(scope="module")
def scorer():
    from megatron_omni.reward.registry import build_scorer

    s = build_scorer("ocr")
    yield s
    s.close()


def test_rendered_words_read_back(scorer) -> None:
    """Every vocabulary word, twice with random size/position/colours: the OCR reward of the rendered
    image for its own prompt is 1 for (nearly) all, so a model that renders like the dataset scores 1."""
    images, words = render_dataset(VOCABULARY, 2 * len(VOCABULARY), seed=123)
    rewards = scorer([np.asarray(im) for im in images], [prompt_for(w) for w in words])
    assert np.mean(rewards) >= 0.97, list(zip(words, rewards))
    assert min(rewards) >= 0.5, list(zip(words, rewards))
    # and a wrong prompt does not score 1: the reader reads the word, not anything
    wrong = scorer([np.asarray(images[0])], [prompt_for("ZZZZ")])
    assert wrong[0] < 0.5


def test_dataset_is_reproducible_and_varied() -> None:
    a, wa = render_dataset(VOCABULARY, 40, seed=7)
    b, wb = render_dataset(VOCABULARY, 40, seed=7)
    c, _ = render_dataset(VOCABULARY, 40, seed=8)
    assert wa == wb and wa[:len(VOCABULARY)] == list(VOCABULARY)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, c))
    # the same word at different draws differs in position/size/colour
    assert not np.array_equal(np.asarray(a[0]), np.asarray(a[len(VOCABULARY)]))
    x = images_to_tensor(a)
    assert x.shape == (40, 3, 64, 64) and x.dtype == np.float32 and x.min() >= -1 and x.max() <= 1


def _ink_box(image) -> tuple[int, int, int, int]:
    dark = np.asarray(image.convert("L")) < 128
    ys, xs = np.nonzero(dark)
    return int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())


def test_fixed_layout_draws_each_word_one_way_and_it_reads_back(scorer) -> None:
    """Centred, one size, black on white: every draw of a word is the same image, the ink box is centred
    (within a pixel of rounding and the glyphs' side bearings), and the reader reads every word."""
    layout = TextLayout(max_offset=0, font_sizes=(15,), colours="fixed")
    images, words = render_dataset(VOCABULARY, 2 * len(VOCABULARY), seed=5, layout=layout)
    n = len(VOCABULARY)
    assert all(np.array_equal(np.asarray(images[i]), np.asarray(images[i + n])) for i in range(n))
    for image in images[:n]:
        arr = np.asarray(image)
        assert set(map(tuple, arr.reshape(-1, 3)[[0, -1]])) == {(255, 255, 255)}
        x0, y0, x1, y1 = _ink_box(image)
        assert abs((x0 + x1) / 2 - 31.5) <= 1.5 and abs((y0 + y1) / 2 - 31.5) <= 1.5, (x0, y0, x1, y1)
    rewards = scorer([np.asarray(im) for im in images[:n]], [prompt_for(w) for w in words[:n]])
    assert min(rewards) == 1.0, list(zip(words, rewards))


def test_layout_narrows_only_what_it_names() -> None:
    """A bounded offset with one size: positions vary within the bound of the centred box, the ink height does
    not; the default moves words much further."""
    centred = _ink_box(render_word("CAT", np.random.default_rng(0), layout=TextLayout(0, (15,), "fixed")))
    layout = TextLayout(max_offset=4, font_sizes=(15,), colours="fixed")
    images, _ = render_dataset(("CAT",), 40, seed=3, layout=layout)
    boxes = [_ink_box(im) for im in images]
    assert len({b[3] - b[1] for b in boxes}) == 1 and len({b[:2] for b in boxes}) > 10
    assert max(max(abs(b[0] - centred[0]), abs(b[1] - centred[1])) for b in boxes) == 4
    # whole-token offsets: the word lands on the centred box moved by -8, 0 or 8 px per axis
    on_grid = render_dataset(("CAT",), 40, seed=3, layout=TextLayout(8, (15,), "fixed", offset_step=8))[0]
    moves = {(b[0] - centred[0], b[1] - centred[1]) for b in map(_ink_box, on_grid)}
    assert moves == {(dx, dy) for dx in (-8, 0, 8) for dy in (-8, 0, 8)}, moves
    anywhere = [_ink_box(im) for im in render_dataset(("CAT",), 40, seed=3)[0]]
    assert max(max(abs(b[0] - centred[0]), abs(b[1] - centred[1])) for b in anywhere) > 10


@pytest.mark.parametrize("kwargs, message", [
    ({"max_offset": -1}, "max_offset"), ({"colours": "rainbow"}, "colours"), ({"font_sizes": ()}, "font_sizes"),
    ({"font_sizes": (15, 6)}, "font_sizes"),
    ({"offset_step": 0}, "offset_step"),
])
def test_bad_layout_is_refused_by_name(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        TextLayout(**kwargs)


def test_word_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        render_word("ABCDEFGHIJKLMNOP", np.random.default_rng(0))


def test_rl_and_held_out_words_split_the_vocabulary() -> None:
    assert set(RL_WORDS) | set(HELD_OUT_WORDS) == set(VOCABULARY)
    assert not set(RL_WORDS) & set(HELD_OUT_WORDS)


def test_miniature_tokenizer_drops_exactly_the_system_prompt() -> None:
    """QwenImagePipeline drops the first 34 template tokens; with the miniature's merges those are exactly
    the system part, so the conditioning starts at the user prompt (one token per character)."""
    from diffusers import QwenImagePipeline

    from model_providers.ocr_miniature.text_miniature import MINIATURE
    from model_providers.qwen_image.tiny_pipeline import build_components

    pipe = QwenImagePipeline(**build_components(MINIATURE, seed=0))
    assert pipe.prompt_template_encode_start_idx == 34
    ids = pipe.tokenizer(pipe.prompt_template_encode.format('text "CAT"'))["input_ids"]
    kept = pipe.tokenizer.decode(ids[34:])
    assert kept == 'text "CAT"<|im_end|>\n<|im_start|>assistant\n', kept
    assert len(ids) - 34 == len('text "CAT"') + 5
