"""Gemma 3 is served: the registry finds gemma3 checkpoints and its preset."""

from __future__ import annotations

from pathlib import Path

from common.checkpoint import load_config
from common.families import FAMILIES, family_of, find_family, preset_names
from common.families.gemma3 import FAMILY
from common.families.registry import NOT_SERVED_YET


def test_in_registry(gemma3_tiny_dir: Path) -> None:
    assert FAMILY in FAMILIES and "gemma3" not in NOT_SERVED_YET
    assert "gemma-3-tiny" in preset_names()
    config = load_config(gemma3_tiny_dir)
    assert find_family(config) is FAMILY and family_of(config) is FAMILY


def test_family_fields() -> None:
    assert FAMILY.hf_class == "Gemma3ForConditionalGeneration"
    assert FAMILY.model_types == ("gemma3",)
    assert not FAMILY.dynamic_resolution and not FAMILY.takes_video
    assert FAMILY.preset_names() == ["gemma-3-tiny", "gemma-3-4b", "gemma-3-12b"]
    layout = FAMILY.layout_class()
    assert layout.__name__ == "Gemma3ImageLayout" and layout.bidirectional_images
