"""Model families are looked up by name: each bundle names its own provider's functions, and an unknown name
fails with the known ones listed."""

import pytest

from model_providers import family_names, get_family
from model_providers.ar_dit import provider as ar_dit_provider
from model_providers.qwen_image import provider as qwen_image_provider
from model_providers.sd3 import provider as sd3_provider


def test_both_families_are_found_by_name():
    assert {"ar_dit", "qwen_image"} <= set(family_names())
    q, a = get_family("qwen_image"), get_family("ar_dit")
    assert q.name == "qwen_image" and q.build_model is qwen_image_provider.build_model
    assert q.megatron_config is qwen_image_provider.transformer_config
    assert a.export_state is ar_dit_provider.hf_state and a.reference_model is ar_dit_provider.torch_hybrid
    assert "tiny" in q.presets and "tiny" in a.presets
    assert q.config("tiny") == qwen_image_provider.hf_config("tiny")


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model family 'no_such_family'.*ar_dit.*qwen_image.*sd3"):
        get_family("no_such_family")


def test_sd3_family_is_a_folder():
    s = get_family("sd3")
    assert s.kind == "dit" and s.build_model is sd3_provider.build_model and s.config("tiny") == sd3_provider.hf_config(
        "tiny")
    assert {"tiny", "sd35-medium", "sd35-large"} <= set(s.presets)


def test_qwen_image_edit_family_reuses_the_qwen_image_model() -> None:
    """The edit family is a folder of its own that builds Qwen-Image's model: its traits say it is conditioned on
    source images, and a built MMDiTModel still maps to qwen_image (one diffusers class, one conversion family)."""
    from megatron_omni.models.dit.model import MMDiTModel
    from model_providers.registry import family_of_model

    edit, qwen = get_family("qwen_image_edit"), get_family("qwen_image")
    assert edit.traits.conditioned and not qwen.traits.conditioned
    assert edit.traits.pipeline_class == "QwenImageEditPlusPipeline"
    assert edit.build_model is qwen.build_model
    assert edit.megatron_module == qwen.megatron_module == "megatron_omni.models.dit.model:MMDiTModel"
    assert not edit.convertible and qwen.convertible
    assert family_of_model(MMDiTModel.__new__(MMDiTModel)).name == "qwen_image"


def test_families_load_lazily_only_the_one_asked_for() -> None:
    """In a fresh interpreter: importing the registry, listing the families and the diffusers classes imports no
    family; finding the family of an SD3.5 diffusers config imports SD3.5's modules (and the Qwen-Image helpers it
    shares) but no other family's bundle or provider, nor transformers/scipy (Qwen-Image-Edit's processor), nor
    megatron-core."""
    import subprocess
    import sys
    from pathlib import Path

    script = """if True:
    import sys
    from model_providers.registry import FAMILIES, diffusers_classes, family_names, get_family

    def loaded():
        return sorted(m for m in sys.modules if m.startswith("model_providers.") and m.count(".") >= 2)

    assert diffusers_classes()["SD3Transformer2DModel"] == "sd3" and "bagel" in family_names()
    try:
        get_family("no_such_family")
    except ValueError:
        pass
    assert loaded() == [] and "torch" not in sys.modules, loaded()
    from megatron_omni.checkpoint.families import family_of_config

    sd3 = family_of_config(get_family("sd3").config("tiny") | {"_class_name": "SD3Transformer2DModel"}, "c")
    assert sd3.name == "sd3"
    others = [n for n in FAMILIES if n != "sd3"]
    bundles = [m for m in loaded() for n in others if m.startswith((f"model_providers.{n}.family",
                                                                     f"model_providers.{n}.provider"))]
    assert "model_providers.sd3.family" in loaded() and not bundles, bundles
    assert not {"transformers", "scipy"} & set(sys.modules)
    # a bundle names its Megatron model class (ModelFamily.megatron_module) and its provider imports it when it
    # builds one: looking a family up, as a launch script's `--check` does, never pays megatron-core's import
    assert "megatron.core" not in sys.modules
    # nor do the stops before a model exists: --check's run folder and file checks, --dry-run's planner
    import megatron_omni.trainer.config_checks, megatron_omni.trainer.dry_run, megatron_omni.trainer.run_folder
    assert "megatron.core" not in sys.modules
    """
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_registry_lists_every_family_folder() -> None:
    """`FAMILIES` (what the registry knows without importing) names exactly the folders with a family.py, and each
    bundle agrees with its entry (get_family checks diffusers_class and megatron_module); each megatron_module
    names a Megatron model class that exists (the name is all a bundle holds, so a typo would otherwise surface
    only when a checkpoint looks the family of its model up)."""
    import importlib

    from megatron.core.transformer.module import MegatronModule

    from model_providers.registry import FAMILIES, family_folders

    assert sorted(FAMILIES) == family_folders() == family_names()
    for name in family_names():
        fam = get_family(name)
        assert fam.convertible == (FAMILIES[name].diffusers_class is not None), name
        if fam.megatron_module is not None:
            module, cls = fam.megatron_module.split(":")
            assert issubclass(getattr(importlib.import_module(module), cls), MegatronModule), fam.megatron_module
