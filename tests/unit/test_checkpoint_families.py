"""The checkpoint tools detect a diffusers folder's family from the one model-family registry: the class a
config names picks the registered bundle that declares it, and an unknown class names the known families."""

import json
import re

import pytest

from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.families import convertible_families, family_of_config, resolve_diffusers_folder
from model_providers import family_names, get_family
from model_providers.qwen_image import mapping, presets, provider


def _tiny_config(cls: str) -> dict:
    return {"_class_name": cls, "_diffusers_version": "0.35.0", **presets.preset("tiny")}


def test_a_tiny_diffusers_config_is_the_registered_qwen_image_bundle(tmp_path) -> None:
    q = get_family("qwen_image")
    fam = family_of_config(_tiny_config(q.diffusers_class), "config.json")
    assert fam is q and fam.diffusers_class == "QwenImageTransformer2DModel"
    assert (fam.arch_config, fam.mappings, fam.megatron_shapes) == (provider.hf_config, mapping.all_mappings,
                                                                    provider.megatron_shapes)
    assert (fam.hf_to_megatron, fam.megatron_to_hf) == (mapping.hf_to_megatron, mapping.megatron_to_hf)
    assert (fam.num_layers(_tiny_config(q.diffusers_class)), fam.num_heads(_tiny_config(q.diffusers_class))) == (2, 4)
    assert fam.preset_name(_tiny_config(q.diffusers_class)) == "tiny"
    assert fam.preset_name({**_tiny_config(q.diffusers_class), "num_layers": 3}) is None
    # A pipeline folder's transformer is found and detected the same way.
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", q.diffusers_class]}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(_tiny_config(q.diffusers_class)))
    src = resolve_diffusers_folder(tmp_path)
    assert src.family is q and src.pipeline_dir == tmp_path


def test_only_families_with_a_diffusers_conversion_are_detected() -> None:
    names = [f.name for f in convertible_families()]
    assert "qwen_image" in names and "ar_dit" not in names and set(names) <= set(family_names())
    assert get_family("ar_dit").diffusers_class is None and not get_family("ar_dit").convertible
    with pytest.raises(ValueError, match="'ar_dit' has no diffusers conversion"):
        get_family("ar_dit").num_layers({})


def test_an_unknown_class_names_the_known_families() -> None:
    with pytest.raises(CheckpointError, match=r"config.json: unknown model family \(class 'HunyuanDiT2DModel'\)"
                                              r".*'FluxTransformer2DModel'.*'QwenImageTransformer2DModel'.*"
                                              r"'SD3Transformer2DModel'.*'WanTransformer3DModel'.*"
                                              r"known families: \['flux', 'qwen_image', 'sd3', 'wan'\]"):
        family_of_config(_tiny_config("HunyuanDiT2DModel"), "config.json")
    with pytest.raises(CheckpointError, match="no '_class_name'"):
        family_of_config(presets.preset("tiny"), "config.json")


def test_a_config_the_family_cannot_hold_names_the_file() -> None:
    bad = {**_tiny_config("QwenImageTransformer2DModel"), "guidance_embeds": True}
    with pytest.raises(CheckpointError, match="config.json: Qwen-Image variant options not supported"):
        family_of_config(bad, "config.json")


@pytest.mark.parametrize("index, named", [
    ({"transformer_2": ["diffusers", "WanTransformer3DModel"]}, "boundary_ratio=None"),
    ({"boundary_ratio": 0.875}, "transformer_2=None"),
    ({"transformer_2": [None, None], "boundary_ratio": 0.875}, "transformer_2=[None, None]"),
])
def test_a_half_declared_expert_pair_is_refused_by_the_converter(tmp_path, index: dict, named: str) -> None:
    """A pipeline folder naming a second transformer without `boundary_ratio`, or a boundary without the second
    transformer, is refused naming both keys (as the rollout engine refuses it), not converted as one expert."""
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "WanTransformer3DModel"],
                                                          **index}))
    with pytest.raises(CheckpointError, match=f"names both transformer_2 and boundary_ratio.*{re.escape(named)}"):
        resolve_diffusers_folder(tmp_path)
