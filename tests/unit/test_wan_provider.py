"""The Wan family's provider: presets with the published shapes and exact parameter counts (diffusers' module
built on the meta device), a mapping that covers every diffusers tensor with the right shape, the family in the
registry, configs it does not build refused by name, the 3D patch packing and RoPE equal to diffusers', and
the model equal to diffusers' `WanTransformer3DModel` at world size 1 (the layouts: tests/distributed)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from megatron_omni.models.dit.embeddings import patchify_video, rope_rotations, unpatchify_video, wan_rope_angles
from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.parallel.platform import seed_everything
from model_providers import get_family
from model_providers.wan import presets, provider
from model_providers.wan.mapping import all_mappings

PUBLISHED = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b")


def _meta_diffusers(name: str) -> WanTransformer3DModel:
    with torch.device("meta"):
        return WanTransformer3DModel(**provider.hf_config(name))


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_shapes_have_their_exact_parameter_counts(name: str) -> None:
    ref = _meta_diffusers(name)
    assert sum(p.numel() for p in ref.parameters()) == presets.PARAMS[name] == provider.parameter_count(name)
    # every diffusers tensor is mapped once, with the shape the Megatron tensor implies
    shapes = provider.megatron_shapes(name)
    hf_shapes = {}
    for m in all_mappings(provider.hf_config(name)["num_layers"]):
        full = shapes[m.megatron]
        each = (full[0] // 3, *full[1:]) if m.kind == "fuse_qkv" else full
        hf_shapes.update({n: each for n in m.hf})
    assert hf_shapes == {n: tuple(p.shape) for n, p in ref.named_parameters()}
    # one rank holds all at tp=1; at tp=2 half of every split tensor
    split = sum(math.prod(shapes[m.megatron]) for m in all_mappings(c_layers(name)) if m.tp_dim is not None)
    assert provider.per_rank_parameter_counts(name, tp=1) == [presets.PARAMS[name]]
    assert provider.per_rank_parameter_counts(name, tp=2) == [presets.PARAMS[name] - split // 2]


def c_layers(name: str) -> int:
    return provider.hf_config(name)["num_layers"]


def test_family_is_registered_and_converts_by_its_class() -> None:
    fam = get_family("wan")
    assert fam.kind == "dit" and fam.convertible and fam.diffusers_class == "WanTransformer3DModel"
    assert set(PUBLISHED) | {"tiny", "small", "wan2.2-t2v-a14b"} == set(fam.presets)  # A14B: two 14B experts
    assert fam.preset_name(dict(_meta_diffusers("wan2.1-t2v-14b").config)) == "wan2.1-t2v-14b"
    assert fam.num_heads(provider.hf_config("wan2.2-ti2v-5b")) == 24
    assert fam.tiny_pipeline is not None


@pytest.mark.parametrize("change, match", [
    (dict(image_dim=1280, added_kv_proj_dim=5120), "image_dim"),
    (dict(qk_norm="rms_norm"), "qk_norm"),
    (dict(cross_attn_norm=False), "cross_attn_norm"),
    (dict(ffn_dim=None), None),
])
def test_configs_it_does_not_build_are_refused_by_name(change: dict, match: str | None) -> None:
    cfg = dict(presets.preset("tiny"), **change)
    if match is None:
        del cfg["ffn_dim"]
        match = "lacks.*ffn_dim"
    with pytest.raises(ValueError, match=match):
        provider.hf_config(cfg)


def test_patch_packing_and_rope_equal_diffusers() -> None:
    g = torch.Generator().manual_seed(0)
    video = torch.randn(2, 3, 5, 4, 6, generator=g)
    for patch in ((1, 2, 2), (1, 1, 2), (5, 2, 1)):
        tokens = patchify_video(video, patch)
        grid = (5 // patch[0], 4 // patch[1], 6 // patch[2])
        assert torch.equal(unpatchify_video(tokens, grid, patch), video)
        conv = torch.nn.Conv3d(3, 8, kernel_size=patch, stride=patch)
        want = conv(video).flatten(2).transpose(1, 2)
        got = torch.nn.functional.linear(tokens, conv.weight.flatten(1), conv.bias)
        assert torch.allclose(got, want, atol=1e-6)
    rope = WanRotaryPosEmbed(attention_head_dim=16, patch_size=(1, 2, 2), max_seq_len=1024)
    cos, sin = (t[0, :, 0] for t in rope(torch.zeros(1, 4, 3, 8, 12)))
    cfg = provider.transformer_config("tiny")
    rot = rope_rotations(wan_rope_angles(3, 4, 6, cfg.rope_axes_dims, cfg.rope_theta))
    assert torch.equal(rot.real, cos[:, 0::2]) and torch.equal(rot.imag, sin[:, 1::2])


@pytest.fixture(scope="module")
def one_rank():
    platform.init_distributed(rank=0, world_size=1)
    yield build_parallel_groups(ParallelLayout())
    platform.destroy_distributed()


def _parity(groups, cfg: dict, sigma: torch.Tensor, per_token: bool) -> None:
    """Our model equals diffusers' module of `cfg` (forward and every gradient) on a 3 x 2 x 3 patch grid; with
    `per_token` the timestep is diffusers' per-token one (Wan2.2 TI2V, `expand_timesteps`): sigma [2, 18]."""
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    seed_everything(0)
    model = provider.build_model(provider.transformer_config(cfg), groups)
    provider.load_hf_state_dict(model, ref.state_dict())
    g = torch.Generator().manual_seed(1)
    video = torch.randn(2, cfg["in_channels"], 3, 4, 6, generator=g)
    text = torch.randn(2, 7, cfg["text_dim"], generator=g)
    text[1, 3:] = 0  # a shorter prompt, zero-padded
    want = patchify_video(ref(hidden_states=video, timestep=sigma * 1000, encoder_hidden_states=text,
                              return_dict=False)[0], (1, 2, 2))
    got = model(DiTBatch(patchify_video(video, (1, 2, 2)), text, None, sigma, (3, 2, 3)))
    assert float((got - want).norm() / want.norm()) < 1e-5
    w = torch.randn(want.shape, generator=g)
    (want * w).sum().backward()
    (got * w).sum().backward()
    ours = provider.stage_hf_tensors(model, {n: p.grad for n, p in model.named_parameters()})
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert ours.keys() == ref_grads.keys()
    for n, gr in ref_grads.items():
        assert float((ours[n] - gr).norm() / gr.norm()) < 1e-4, n
    with pytest.raises(ValueError, match="does not match 36 video tokens" if per_token else "do not match grid"):
        model(DiTBatch(patchify_video(video, (1, 2, 2)), text, None, sigma, (3, 4, 3)))
    if per_token:
        # a per-token sigma of another length is refused; the timesteps move the output (the test can fail)
        with pytest.raises(ValueError, match="per-token sigma"):
            model(DiTBatch(patchify_video(video, (1, 2, 2)), text, None, sigma[:, 1:], (3, 2, 3)))
        flat = model(DiTBatch(patchify_video(video, (1, 2, 2)), text, None, sigma[:, -1], (3, 2, 3)))
        assert float((flat - want)[:, :6].abs().max()) > 1e-3


def test_model_equals_diffusers_at_world_size_one(one_rank) -> None:
    cfg = provider.hf_config("tiny")
    assert sum(p.numel() for p in provider.build_model(provider.transformer_config("tiny"), one_rank).parameters()) \
        == provider.parameter_count("tiny")
    _parity(one_rank, cfg, torch.tensor([0.9, 0.31]), per_token=False)


def test_ti2v_layout_with_per_token_timesteps_equals_diffusers(one_rank) -> None:
    """Wan2.2-TI2V's layout: 48 latent channels, and per-token timesteps with the image-conditioned first latent
    frame (its 2 x 3 tokens) at t = 0, as `WanImageToVideoPipeline(expand_timesteps=True)` feeds them."""
    cfg = dict(provider.hf_config("tiny"), in_channels=48, out_channels=48)
    sigma = torch.tensor([0.9, 0.31])[:, None].repeat(1, 18)
    sigma[:, :6] = 0.0
    _parity(one_rank, cfg, sigma, per_token=True)
