"""Phi-4-MM's declaration: its folder's FAMILY is registered and served (its checkpoint's vision LoRA a
built-in adapter), its tiny checkpoint is HF's format with the adapters in the real checkpoint's naming,
and its layout refuses what it cannot count."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from common.checkpoint import load_config
from common.families import family_for_preset, family_of
from common.families.family import load_attr
from common.families.phi4mm import FAMILY
from common.families.phi4mm.layout import Phi4ImageLayout, UnsupportedPhi4ConfigError, phi4_layout
from common.families.phi4mm.pixels import PixelSettings
from common.families.registry import FAMILIES, NOT_SERVED_YET


def test_registered_and_served():
    assert FAMILY.name not in NOT_SERVED_YET and FAMILY in FAMILIES
    assert family_of({"model_type": "phi4_multimodal"}) is FAMILY
    assert family_for_preset("phi-4-mm-tiny") is FAMILY and FAMILY.checkpoint_adapters == ("vision",)
    for ref in (FAMILY.vision_encoder, FAMILY.maker, FAMILY.presets, FAMILY.layout, FAMILY.oracle):
        assert load_attr(ref)
    assert set(FAMILY.preset_names()) == {"phi-4-mm-tiny", "phi-4-mm"}
    assert FAMILY.layout_class().sized_by_image == FAMILY.dynamic_resolution


def test_the_tiny_checkpoint_is_hf_format(phi4_tiny_dir, phi4_oracle):
    config = load_config(phi4_tiny_dir)
    assert config["model_type"] == "phi4_multimodal"
    processor = json.loads((phi4_tiny_dir / "processor_config.json").read_text())
    assert processor["image_processor"]["image_processor_type"] == "Phi4MultimodalImageProcessor"
    tok = phi4_oracle.tokenizer
    assert tok.image_token == "<|image|>" and tok.image_token_id == config["vision_config"]["image_token_id"]
    layout = Phi4ImageLayout.from_checkpoint(phi4_tiny_dir, config)
    assert layout.image_token == "<|image|>" and layout.settings.dynamic_hd == 16
    assert len(phi4_oracle.generate("<|user|>hello<|end|><|assistant|>", [], 4)) == 4


def test_the_layout_refuses_other_crop_shapes(phi4_tiny_dir):
    config = load_config(phi4_tiny_dir)
    with pytest.raises(UnsupportedPhi4ConfigError, match="only 448 px crops"):
        phi4_layout(config, {"size": {"height": 336, "width": 336}})
    with pytest.raises(UnsupportedPhi4ConfigError, match="non-square"):
        phi4_layout(config, {"size": {"height": 448, "width": 336}})
    with pytest.raises(UnsupportedPhi4ConfigError, match="not Phi-4"):
        phi4_layout({"model_type": "llava"}, {})


def test_grids_and_counts(phi4_tiny_dir):
    layout = Phi4ImageLayout.from_checkpoint(phi4_tiny_dir, load_config(phi4_tiny_dir))
    assert layout.grid(448, 448) == (1, 16, 16) and layout.num_tokens((1, 16, 16)) == 16 * 17 + 273
    assert layout.check_grid([1, 32, 20]) == (1, 32, 20)
    with pytest.raises(Exception, match="dynamic_hd"):
        layout.check_grid([1, 16 * 5, 16 * 4])  # 20 crops > 16
    assert layout.generic_image_text("<|image|>") == "<|image|>" and layout.tokens_per_image is None


def _altered(value):
    """Other values of a setting: each channel of a tuple changed on its own, a number doubled."""
    if isinstance(value, tuple):
        return [value[:i] + (value[i] * 2 + 0.125,) + value[i + 1:] for i in range(len(value))]
    return [value * 2]


def test_every_pixel_setting_changes_the_image_hash():
    """Cache correctness: the HD transform's settings (the image processor config, which the checkpoint's
    fingerprint does not cover) all change an image's pixels, so each is in the hash key."""
    base = PixelSettings()
    keys = {Phi4ImageLayout(base).hash_key}
    for field in fields(PixelSettings):
        for value in _altered(getattr(base, field.name)):
            key = Phi4ImageLayout(replace(base, **{field.name: value})).hash_key
            assert key not in keys, (field.name, value)
            keys.add(key)


def test_the_configs_normalisation_reaches_the_hash_key():
    config = {"model_type": "phi4_multimodal"}
    default = phi4_layout(config, {}).hash_key
    for name in ("image_mean", "image_std"):
        for channel in range(3):
            values = [0.5, 0.5, 0.5]
            values[channel] = 0.25
            assert phi4_layout(config, {name: values}).hash_key != default, (name, channel)
    assert phi4_layout(config, {"rescale_factor": 1 / 127.5}).hash_key != default
