"""Scorers in-process: OCR on rendered images, JPEG (in)compressibility, weighted sums, user scorers."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.errors import RewardInputError, RewardScorerError
from megatron_omni.reward.registry import available_scorers, build_scorer, register_scorer
from megatron_omni.reward.scorers import JpegCompressibility, Scorer, WeightedSum

FONT = "DejaVuSans-Bold.ttf"


def render(text: str, size: tuple[int, int] = (160, 64), font_size: int = 22) -> Image.Image:
    """Black text on white, as a rollout asked to write `text` at its best would produce."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype(FONT, font_size)
    w = draw.textlength(text, font=font)
    draw.text(((size[0] - w) / 2, size[1] / 2 - font_size / 2), text, fill="black", font=font)
    return img


def noise(seed: int, size: tuple[int, int] = (128, 128)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ocr() -> Scorer:
    return build_scorer("ocr")


# ----------------------------------------------------------------------------------------------- OCR


@pytest.mark.parametrize("word", ["HELLO", "OPEN 24H", "Coffee", "REWARD", "42"])
def test_ocr_right_text_scores_high(ocr: Scorer, word: str) -> None:
    (r,) = ocr([render(word)], [f'A sign that says "{word}"'])
    assert r >= 0.95


def test_ocr_partial_text_in_between(ocr: Scorer) -> None:
    r_partial, r_wrong_letter = ocr([render("HELL"), render("HELPO")], ['"HELLO"', '"HELLO"'])
    assert 0.5 <= r_partial < 0.95  # one of five letters missing: 0.8 when read exactly
    assert 0.5 <= r_wrong_letter < 0.95


def test_ocr_blank_and_noise_score_zero(ocr: Scorer) -> None:
    blank = Image.new("RGB", (128, 128), "white")
    black = np.zeros((128, 128, 3), np.uint8)
    rewards = ocr([blank, black, noise(0), noise(1)], ['"HELLO"'] * 4)
    assert rewards == [0.0, 0.0, 0.0, 0.0]


def test_ocr_legibility_is_continuous_and_ranks_images(ocr: Scorer) -> None:
    """RapidOcrReader.legibility: ~1 for the word clearly written (either case); lower, and lower still, as a
    blur makes it less legible while the step-function reward still reads it; ~0 for a blank image (no box: the
    whole image is scored) and a different word; low for a one-letter error. 64 px images, as the rollouts'."""
    from PIL import ImageFilter

    def word(text: str) -> Image.Image:
        return render(text, size=(64, 64), font_size=14)

    clear = word("HELLO")
    images = [clear, word("hello"), clear.filter(ImageFilter.GaussianBlur(2.5)),
              clear.filter(ImageFilter.GaussianBlur(3)), Image.new("RGB", (64, 64), "white"), word("WORLD"),
              word("HELPO")]
    clear_s, lower_s, blur_s, blurrer_s, blank_s, other_s, typo_s = ocr.reader.legibility(images, ["Hello"] * 7)
    assert clear_s > 0.99 and lower_s > 0.99
    assert ocr(images[2:3], ['"HELLO"']) == [1.0]  # still read exactly: the reward cannot see the blur
    assert clear_s > blur_s + 0.05 and blur_s > blurrer_s + 0.05
    assert blank_s < 0.01 and other_s < 0.01
    assert typo_s < 0.5 * clear_s
    with pytest.raises(RewardInputError, match="targets"):
        ocr.reader.legibility([clear], [])


def test_ctc_log_likelihood_equals_sum_over_alignments() -> None:
    """The case-folded CTC likelihood equals the brute-force sum over every alignment that collapses to the text."""
    import itertools

    from megatron_omni.reward.ocr import ctc_log_likelihood

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), size=4)  # T=4 steps over [blank, a, A, b, c]
    index = {"a": 1, "A": 2, "b": 3, "c": 4}
    folded = np.stack([probs[:, 0], probs[:, 1] + probs[:, 2], probs[:, 3], probs[:, 4]], axis=1)
    total = 0.0
    for path in itertools.product(range(4), repeat=4):  # classes: blank, a|A, b, c
        collapsed = [k for i, k in enumerate(path) if k and (i == 0 or k != path[i - 1])]
        if collapsed == [1, 2]:
            total += float(np.prod(folded[np.arange(4), path]))
    assert ctc_log_likelihood(probs, "ab", index) == pytest.approx(np.log(total), rel=1e-9)
    assert ctc_log_likelihood(probs, "az", index) == -np.inf  # a character the dictionary lacks


def test_ocr_array_input_equals_pil_and_explicit_target(ocr: Scorer) -> None:
    img = render("WORLD")
    arr = np.asarray(img).copy()
    a = ocr([img, arr], ['"WORLD"', '"WORLD"'])
    b = ocr([img], ["no quotes here"], [{"target": "WORLD"}])
    assert a[0] == a[1] == b[0] >= 0.95


def test_ocr_prompt_without_target_raises(ocr: Scorer) -> None:
    with pytest.raises(RewardInputError, match="quotes no text"):
        ocr([render("HI")], ["a plain prompt"])


def test_bad_images_raise(ocr: Scorer) -> None:
    with pytest.raises(RewardInputError, match="uint8"):
        ocr([np.zeros((8, 8, 3), np.float32)], ['"A"'])
    with pytest.raises(RewardInputError, match=r"\(H, W, 3\)"):
        ocr([np.zeros((8, 8), np.uint8)], ['"A"'])
    with pytest.raises(RewardInputError, match="PIL"):
        ocr(["not an image"], ['"A"'])
    with pytest.raises(RewardInputError, match="2 images but 1 prompts"):
        ocr([render("A"), render("B")], ['"A"'])


# ---------------------------------------------------------------------------------------------- JPEG


def _jpeg_kb(img: Image.Image) -> float:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return len(buf.getvalue()) / 1000


def test_jpeg_rewards_are_ddpo_sizes() -> None:
    imgs = [Image.new("RGB", (64, 64), "gray"), noise(2, (64, 64)), render("TEXT")]
    comp = build_scorer("jpeg_compressibility")(imgs, [""] * 3)
    incomp = build_scorer("jpeg_incompressibility")(imgs, [""] * 3)
    expected = [_jpeg_kb(im) for im in imgs]
    assert incomp == pytest.approx(expected, rel=1e-12)
    assert comp == pytest.approx([-e for e in expected], rel=1e-12)
    assert incomp[1] > 5 * incomp[0]  # noise is far less compressible than a flat image


# ------------------------------------------------------------------------------------ sums, user, registry


def test_weighted_sum_equals_sum_of_terms(ocr: Scorer) -> None:
    imgs = [render("HELLO"), render("HELP"), noise(3)]
    prompts = ['"HELLO"'] * 3
    parsed = build_scorer("0.7*ocr+0.01*jpeg_incompressibility")
    as_dict = build_scorer(
        {"weighted": [{"scorer": "ocr", "weight": 0.7}, {"scorer": "jpeg_incompressibility", "weight": 0.01}]}
    )
    o = ocr(imgs, prompts)
    j = build_scorer("jpeg_incompressibility")(imgs, prompts)
    expected = [0.7 * a + 0.01 * b for a, b in zip(o, j)]
    assert parsed(imgs, prompts) == pytest.approx(expected, rel=1e-12)
    assert as_dict(imgs, prompts) == pytest.approx(expected, rel=1e-12)
    assert isinstance(parsed, WeightedSum) and "ocr" in parsed.name


def mean_brightness(images, prompts, metadata):
    """A user scorer: mean pixel value in [0, 1] (plus an offset from metadata)."""
    return [float(np.asarray(im).mean() / 255.0) + m.get("offset", 0.0) for im, m in zip(images, metadata)]


class Redness(Scorer):
    name = "redness"

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def score(self, images, prompts, metadata):
        return [self.scale * float(np.asarray(im)[..., 0].mean()) / 255.0 for im in images]


def nan_scorer(images, prompts, metadata):
    return [float("nan")] * len(images)


def short_scorer(images, prompts, metadata):
    return [1.0]


def test_user_scorer_by_import_path() -> None:
    white, red = Image.new("RGB", (8, 8), "white"), Image.new("RGB", (8, 8), (255, 0, 0))
    fn = build_scorer(f"{__name__}:mean_brightness")
    assert fn([white, red], ["", ""], [{}, {"offset": 1.0}]) == pytest.approx([1.0, 1 + 1 / 3])
    cls = build_scorer(f"{__name__}:Redness", scale=2.0)
    assert cls([white, red], ["", ""]) == pytest.approx([2.0, 2.0])
    mixed = build_scorer(f"0.5*{__name__}:mean_brightness+2*jpeg_compressibility")
    assert mixed([white], [""]) == pytest.approx([0.5 - 2 * _jpeg_kb(white)])


def test_user_scorer_errors() -> None:
    with pytest.raises(RewardInputError, match="cannot import"):
        build_scorer("no_such_module_xyz:fn")
    with pytest.raises(RewardInputError, match="no attribute"):
        build_scorer(f"{__name__}:missing")
    with pytest.raises(RewardScorerError, match="non-finite"):
        build_scorer(f"{__name__}:nan_scorer")([Image.new("RGB", (4, 4))], [""])
    with pytest.raises(RewardScorerError, match="1 rewards for 2"):
        build_scorer(f"{__name__}:short_scorer")([Image.new("RGB", (4, 4))] * 2, ["", ""])


def test_registry() -> None:
    assert {"ocr", "vlm_ocr", "jpeg_compressibility", "jpeg_incompressibility"} <= set(available_scorers())
    with pytest.raises(RewardInputError, match="unknown scorer 'nope'.*jpeg_compressibility"):
        build_scorer("nope")
    register_scorer("test_reward_flat_jpeg", JpegCompressibility, overwrite=True)
    assert isinstance(build_scorer("test_reward_flat_jpeg", quality=50), JpegCompressibility)
    with pytest.raises(RewardInputError, match="already registered"):
        register_scorer("test_reward_flat_jpeg", JpegCompressibility)


class DeviceAware(Scorer):
    name = "device_aware"

    def __init__(self, device: str | None = None):
        self.device = device

    def score(self, images, prompts, metadata):
        return [0.0] * len(images)


def test_device_reaches_scorers_that_take_it() -> None:
    assert build_scorer(f"{__name__}:DeviceAware", device="cpu").device == "cpu"
    assert build_scorer(f"{__name__}:DeviceAware").device is None
    # Scorers without a device argument are built as usual when a device is given.
    assert isinstance(build_scorer("jpeg_compressibility", device="cpu"), JpegCompressibility)
    ocr_on_cpu = build_scorer("ocr", device="cpu")
    assert ocr_on_cpu([Image.new("RGB", (64, 64), "white")], ['"A"']) == [0.0]
