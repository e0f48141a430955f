"""The planner's view of one MMDiT family's transformer and its pipeline (part of the dry-run planner): the
weight shapes from the config alone, where each non-block tensor sits (pipeline stage, and which tokens it acts
on), the constant buffers, the extra image-only attention of some blocks, the layouts the model supports, and the
pipeline's text encoders and VAE (rollout weights and encoder FLOPs).

Two families so far, both joint-attention MMDiTs over [image; text]:
- Qwen-Image (`qwen_image`, and `qwen_image_edit`, the same transformer): a preset name or a diffusers config
  without SD3's keys; Qwen2.5-VL-7B reads the prompt (the edit pipeline's reads the source image too).
- SD3.5 (`sd3`): its presets `sd35-medium` / `sd35-large`, or a diffusers config with `pooled_projection_dim`;
  CLIP-L and CLIP-G (77 tokens each, their penultimate states concatenated and padded to T5's width, their pooled
  outputs the `pooled_embedder`'s input) and T5-XXL (`max_sequence_length` tokens) read the prompt; the text
  stream is [CLIP 77; T5 L]. SD3.5-M's first 13 blocks hold a second image self-attention (`img_attn2`).
- FLUX.1 (`flux`): its preset `flux1-dev` or a diffusers config with `num_single_layers`; `num_layers` double-stream
  blocks (the MMDiT block of Qwen-Image, both streams' outputs kept to the last) then `num_single_layers`
  single-stream blocks over [text; image] (`single_layers.{i}.*`: adaLN 3h, fused QKV, the MLP input projection and
  one output projection over [attention | MLP], all column-parallel, the output projection's 5h inputs all-gathered
  over tp first); CLIP-L (77 tokens, its pooled output only) and T5-XXL (`max_sequence_length` tokens, the whole
  text stream) read the prompt; the guidance embedder reads the distilled guidance scale (one forward per step).

Every planner function that takes `model` accepts a preset name or config (Qwen-Image's, or SD3's when its keys
say so) or a `DiTArch` (what `dit_arch(family, model)` returns; the trainer's dry run passes one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_omni.parallel.layout import LayoutError
from megatron_omni.planner.specs import QWEN_IMAGE_TEXT_ENCODER_PARAMS, QWEN_IMAGE_VAE_PARAMS

# Qwen2.5-VL-7B's vision tower (the edit pipeline runs it over the source image's patches; part of the text
# encoder's 8.29B).
QWEN_VL_VISION_PARAMS = 670_000_000
# SD3.5's text encoders and VAE, counted by building the published configs' classes on the meta device
# (transformers' CLIPTextModelWithProjection for openai/clip-vit-large-patch14 and laion CLIP-ViT-bigG-14,
# T5EncoderModel for google/t5-v1_1-xxl, diffusers' AutoencoderKL with SD3.5's 16 latent channels and no quant
# convs); tests/unit/test_planner_sd3.py builds them again and compares.
SD3_CLIP_L_PARAMS = 123_650_304
SD3_CLIP_G_PARAMS = 694_659_840
SD3_T5_XXL_PARAMS = 4_762_310_656
SD3_VAE_PARAMS = 83_819_683
SD3_CLIP_TOKENS = 77
# FLUX.1's CLIP-L is transformers' CLIPTextModel (no text projection: SD3's CLIP-L less its 768 x 768 projection);
# its T5-XXL and its 16-channel VAE (no quant convs) are SD3's classes and configs.
FLUX_CLIP_L_PARAMS = SD3_CLIP_L_PARAMS - 768 * 768
# Saved activations of a FLUX single-stream block per token of [text; image], `(full, tp_split)` multiples of h,
# measured with saved-tensor hooks on `FluxSingleLayer` (fp32, h 128, 256 image + 64 text tokens, batch 2; the RoPE
# rotations, shared by every block, not counted; tests/distributed/test_planner_memory_allocated.py measures them
# again): 22.25 h per token at tp 1 and 15.70 at tp 2, so split = 2 (22.25 - 15.70) = 13.1 and full = 9.2; the
# planner takes (9, 13) (measured / predicted 1.011 at tp 1, 1.013 at tp 2; the rest is per-token norm statistics
# and the [b, h] modulation vectors). The estimate from the block's code was (9, 17) = 26: the split part has no
# per-stream copies of Q/K/V and its GELU input is fc1's output, saved once.
FLUX_SINGLE_SAVED_PER_TOKEN = (9, 13)

_SD3_PRESETS = ("sd35-medium", "sd35-large")
# Saved activations of an SD3 block per token, `(full, tp_split)` multiples of h, measured with saved-tensor hooks
# on `SD3Layer` at tp 1 and 2 (tests/distributed/test_planner_memory_allocated.py measures them again): a plain
# block 8 + 18 (Qwen-Image's 8 + 17, plus one more tp-split tensor), a dual-attention block's second image attention
# 2 + 10 per image token (its modulated input and output for the gate; QKV, Q/K/V/out, QK-norm intermediates).
SD3_SAVED_PER_TOKEN = {"none": (8, 18)}
SD3_IMAGE_ATTENTION_SAVED = (2, 10)


@dataclass(frozen=True)
class TextEncoder:
    """One encoder the rollout runs once per prompt: `params` weights over `tokens` tokens (None: the text stream's
    tokens that the fixed-length encoders do not fill, `DiTArch.fixed_text_tokens` fewer)."""

    name: str
    params: int
    tokens: int | None = None


@dataclass(frozen=True)
class DiTArch:
    """What the planner reads about one family's transformer (see the module docstring).

    name: printed (the preset, or "custom"); config: the diffusers architecture keys; shapes: every Megatron
    tensor's full shape. every_stage / first_stage / last_stage: name prefixes of the non-block tensors each
    pipeline stage holds; image_weights / text_weights / sample_weights: non-block weights acting on image tokens,
    text tokens, or once per sample. buffers: constant tensors (in the model's dtype, not trained: no gradient, no
    optimizer state) and the stage that holds them. image_attention_layers: blocks with a second self-attention
    over the image tokens. last_text_queries: the last block's text queries attend (SD3: diffusers computes them)
    or are skipped (Qwen-Image). recompute_modes / cp / pp: what the Megatron model supports. saved_per_token:
    a block's saved activations per token per recompute mode as `(full, tp_split)` multiples of h (None:
    Qwen-Image's, measured on its block, `memory._SAVED_PER_TOKEN`); image_attention_saved: what a second image
    attention adds per image token. single_layers: single-stream blocks after the `layers` double ones (FLUX; tensors
    `single_layers.{i}.*`), single_saved their saved activations per token without recompute; text_output_last: the
    last double block's text stream runs whole (FLUX: the single blocks read it); latent_pack: latent pixels per token
    side before the transformer's own patch (FLUX packs 2 x 2 latents into one token, patch_size 1). text_encoders,
    fixed_text_tokens, vae_params: the pipeline's other weights; t5_padded: the text stream is the fixed-length
    encoders' tokens then T5 padded to `rollout.max_sequence_length` (SD3.5, FLUX.1), not a prompt budget."""

    family: str
    name: str
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    every_stage: tuple[str, ...]
    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    image_weights: tuple[str, ...]
    text_weights: tuple[str, ...]
    sample_weights: tuple[str, ...]
    text_encoders: tuple[TextEncoder, ...]
    vae_params: int
    buffers: tuple[str, ...] = ()
    image_attention_layers: tuple[int, ...] = ()
    last_text_queries: bool = False
    fixed_text_tokens: int = 0
    t5_padded: bool = False
    recompute_modes: tuple[str, ...] = ("none", "selective", "full")
    saved_per_token: dict[str, tuple[int, int]] | None = None
    image_attention_saved: tuple[int, int] = (0, 0)
    cp: bool = True
    pp: bool = True
    single_layers: int = 0
    single_saved: tuple[int, int] = (0, 0)
    text_output_last: bool = False
    latent_pack: int = 1

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def blocks(self) -> int:
        """Every block: the double-stream (or only) ones and the single-stream ones."""
        return self.layers + self.single_layers

    @property
    def hidden(self) -> int:
        return int(self.config["num_attention_heads"] * self.config["attention_head_dim"])

    @property
    def patch(self) -> int:
        """Latent pixels per token side (the packing times the transformer's patch)."""
        return self.latent_pack * int(self.config["patch_size"])

    @property
    def extra_params(self) -> int:
        """Weights the rollout pipeline holds beside the transformer: its text encoders and VAE."""
        return sum(e.params for e in self.text_encoders) + self.vae_params

    def encoder_flops(self, text_tokens: int) -> float:
        """FLOPs of encoding one prompt whose text stream holds `text_tokens` tokens (2 x params per token)."""
        rest = text_tokens - self.fixed_text_tokens
        return sum(2.0 * e.params * (rest if e.tokens is None else e.tokens) for e in self.text_encoders)

    def check_layout(self, tp: int, cp: int, pp: int, recompute: str) -> None:
        """Raise LayoutError naming what the family's Megatron model cannot run (CP, PP, a recompute mode)."""
        if cp > 1 and not self.cp:
            raise LayoutError(f"the {self.family} model has no context parallelism yet (cp={cp}): use tp and dp")
        if pp > 1 and not self.pp:
            raise LayoutError(f"the {self.family} model has no pipeline parallelism yet (pp={pp}): use tp and dp")
        if recompute not in self.recompute_modes:
            raise LayoutError(f"the {self.family} model has no {recompute!r} recompute; it has "
                              f"{self.recompute_modes}")


def qwen_image_arch(model: str | dict[str, Any], family: str = "qwen_image") -> DiTArch:
    """Qwen-Image's transformer (a preset name or diffusers config); `family` qwen_image_edit reads the source
    image with the VL model's vision tower too (counted by `with_edit_sources`)."""
    from model_providers.qwen_image.provider import hf_config, megatron_shapes

    cfg = hf_config(model)
    return DiTArch(
        family=family, name=model if isinstance(model, str) else "custom", config=cfg, shapes=megatron_shapes(cfg),
        every_stage=("time_embedder.",), first_stage=("img_in.", "txt_norm.", "txt_in."),
        last_stage=("norm_out.", "proj_out."), image_weights=("img_in.weight", "proj_out.weight"),
        text_weights=("txt_in.weight",),
        sample_weights=("time_embedder.linear_1.weight", "time_embedder.linear_2.weight", "norm_out.linear.weight"),
        text_encoders=(TextEncoder("Qwen2.5-VL-7B", QWEN_IMAGE_TEXT_ENCODER_PARAMS),),
        vae_params=QWEN_IMAGE_VAE_PARAMS)


def sd3_arch(model: str | dict[str, Any]) -> DiTArch:
    """SD3.5's transformer (a preset name or diffusers config): TP, CP (Ulysses x ring over the image tokens, the
    prompt whole on every CP rank) and PP over its blocks; full recompute only (no selective checkpoint in
    `SD3Layer`); the sincos table a constant buffer on the first stage."""
    from model_providers.sd3.provider import hf_config, megatron_shapes

    cfg = hf_config(model)
    return DiTArch(
        family="sd3", name=model if isinstance(model, str) else "custom", config=cfg, shapes=megatron_shapes(cfg),
        every_stage=("time_embedder.", "pooled_embedder."), first_stage=("patch_embed.", "context_embedder."),
        last_stage=("norm_out.", "proj_out."), image_weights=("patch_embed.proj.weight", "proj_out.weight"),
        text_weights=("context_embedder.weight",),
        sample_weights=("time_embedder.linear_1.weight", "time_embedder.linear_2.weight",
                        "pooled_embedder.linear_1.weight", "pooled_embedder.linear_2.weight",
                        "norm_out.linear.weight"),
        text_encoders=(TextEncoder("CLIP-L", SD3_CLIP_L_PARAMS, SD3_CLIP_TOKENS),
                       TextEncoder("CLIP-G", SD3_CLIP_G_PARAMS, SD3_CLIP_TOKENS),
                       TextEncoder("T5-XXL", SD3_T5_XXL_PARAMS)),
        vae_params=SD3_VAE_PARAMS, buffers=("patch_embed.pos_embed",),
        image_attention_layers=tuple(cfg["dual_attention_layers"]), last_text_queries=True,
        fixed_text_tokens=SD3_CLIP_TOKENS, t5_padded=True, recompute_modes=("none", "full"),
        saved_per_token=SD3_SAVED_PER_TOKEN, image_attention_saved=SD3_IMAGE_ATTENTION_SAVED)


def flux_arch(model: str | dict[str, Any]) -> DiTArch:
    """FLUX.1's transformer (a preset name or diffusers config): TP, CP (Ulysses x ring over the image tokens; the
    text part of every block's sequence whole on every CP rank) and PP over all its blocks in model order (double,
    then single: `blocks` must divide by pp; FLUX.1-dev's 19 + 38 = 57 split over 3 or 19 stages); no
    selective recompute (full checkpoints every block, double then single), no constant buffers (RoPE is computed
    per forward). The guidance embedder, like the timestep and pooled ones, acts once per sample."""
    from model_providers.flux.provider import hf_config, megatron_shapes

    cfg = hf_config(model)
    shapes = megatron_shapes(cfg)
    return DiTArch(
        family="flux", name=model if isinstance(model, str) else "custom", config=cfg, shapes=shapes,
        every_stage=("time_embedder.", "guidance_embedder.", "pooled_embedder."),
        first_stage=("x_embedder.", "context_embedder."), last_stage=("norm_out.", "proj_out."),
        image_weights=("x_embedder.weight", "proj_out.weight"), text_weights=("context_embedder.weight",),
        sample_weights=tuple(f"{e}.linear_{i}.weight" for e in ("time_embedder", "guidance_embedder",
                                                                "pooled_embedder") for i in (1, 2)
                             if f"{e}.linear_{i}.weight" in shapes) + ("norm_out.linear.weight",),
        text_encoders=(TextEncoder("CLIP-L", FLUX_CLIP_L_PARAMS, SD3_CLIP_TOKENS), TextEncoder("T5-XXL",
                                                                                              SD3_T5_XXL_PARAMS)),
        vae_params=SD3_VAE_PARAMS, last_text_queries=True, recompute_modes=("none", "full"),
        single_layers=int(cfg["num_single_layers"]), single_saved=FLUX_SINGLE_SAVED_PER_TOKEN,
        text_output_last=True, latent_pack=2, t5_padded=True)


@dataclass(frozen=True)
class EditTokens:
    """What one source image adds to an edit job's forward (diffusers' `QwenImageEditPlusPipeline`): its VAE
    latents' tokens in the image stream (`condition`), the Qwen2.5-VL vision tokens in the text stream (`vision`:
    merged 2 x 2 patches) and the vision tower's patches (`patches`, 14 x 14 pixels each)."""

    condition: int
    vision: int
    patches: int


def edit_tokens(height: int, width: int, condition_area: int, vae_area: int, patch: int = 2,
                vae_scale_factor: int = 8) -> EditTokens:
    """The tokens of one `width x height` source (the planner assumes the target's aspect) resized as the edit
    pipeline resizes it (`model_providers.qwen_image_edit.conditioning`: about `vae_area` pixels for the VAE,
    `condition_area` for the text encoder, whose processor rounds each side to a multiple of 28)."""
    from model_providers.qwen_image_edit.conditioning import EditAreas

    areas = EditAreas(condition_area=condition_area, vae_area=vae_area)
    vw, vh = areas.vae_size(width, height)
    cw, ch = areas.condition_size(width, height)
    step = vae_scale_factor * patch
    rows, cols = max(28, round(ch / 28) * 28) // 14, max(28, round(cw / 28) * 28) // 14
    return EditTokens(condition=(vh // step) * (vw // step), vision=rows * cols // 4, patches=rows * cols)


def qwen_image_edit_arch(model: str | dict[str, Any], patches: int) -> DiTArch:
    """Qwen-Image-Edit: Qwen-Image's transformer; its text encoder's vision tower reads `patches` patches of the
    source per prompt, its language model the text stream (instruction and vision tokens)."""
    base = qwen_image_arch(model, "qwen_image_edit")
    return replace(base, text_encoders=(
        TextEncoder("Qwen2.5-VL-7B language model", QWEN_IMAGE_TEXT_ENCODER_PARAMS - QWEN_VL_VISION_PARAMS),
        TextEncoder("Qwen2.5-VL-7B vision tower", QWEN_VL_VISION_PARAMS, patches)))


def dit_arch(family: str, model: str | dict[str, Any]) -> DiTArch:
    """The planner's view of `model` (a preset name or diffusers config) of DiT family `family`; raises LayoutError
    for a family without a cost model."""
    if family in ("qwen_image", "qwen_image_edit"):
        return qwen_image_arch(model, family)
    if family == "sd3":
        return sd3_arch(model)
    if family == "flux":
        return flux_arch(model)
    raise LayoutError(f"the planner has no cost model for model.family={family}")


def job_arch(family: str, model: str | dict[str, Any], pipeline: str, height: int, width: int
             ) -> tuple[DiTArch, int, int]:
    """The planner's view of a job's model with what conditions each prompt: (arch, tokens the conditioning adds
    to the text stream, tokens it adds to the image stream). Qwen-Image-Edit: one `width x height` source resized
    by the areas of `pipeline` (its `edit_config.json`; "tiny": the tiny pipeline's; a folder without one:
    diffusers' defaults, so a dry run without the folder plans those). Other families: (dit_arch, 0, 0)."""
    if family != "qwen_image_edit":
        return dit_arch(family, model), 0, 0
    from model_providers.qwen_image_edit.conditioning import EditAreas
    from model_providers.qwen_image_edit.tiny_pipeline import TinyEditConfig

    areas = TinyEditConfig().areas if pipeline == "tiny" else EditAreas.of_folder(pipeline)
    src = edit_tokens(height, width, areas.condition_area, areas.vae_area)
    return qwen_image_edit_arch(model, src.patches), src.vision, src.condition


def arch_of(model: str | dict[str, Any] | DiTArch) -> DiTArch:
    """`model` as a `DiTArch`: one already, a FLUX.1 preset or config (it has `num_single_layers`), an SD3.5 one
    (it has `pooled_projection_dim`), else Qwen-Image's."""
    if isinstance(model, DiTArch):
        return model
    if (isinstance(model, str) and model == "flux1-dev") or (isinstance(model, dict)
                                                            and "num_single_layers" in model):
        return flux_arch(model)
    if (isinstance(model, str) and model in _SD3_PRESETS) or (isinstance(model, dict)
                                                              and "pooled_projection_dim" in model):
        return sd3_arch(model)
    return qwen_image_arch(model)
