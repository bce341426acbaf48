"""Gemma 3 is declared but not served: the registry keeps refusing gemma3 checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.checkpoint import load_config
from common.families import FAMILIES, UnsupportedModelError, family_of, find_family, preset_names
from common.families.gemma3 import FAMILY


def test_not_in_registry(gemma3_tiny_dir: Path) -> None:
    assert FAMILY not in FAMILIES
    assert "gemma3" not in [f.name for f in FAMILIES]
    assert "gemma-3-tiny" not in preset_names()
    config = load_config(gemma3_tiny_dir)
    assert find_family(config) is None
    with pytest.raises(UnsupportedModelError, match="'gemma3' is not served"):
        family_of(config)


def test_family_fields() -> None:
    assert FAMILY.hf_class == "Gemma3ForConditionalGeneration"
    assert FAMILY.model_types == ("gemma3",)
    assert not FAMILY.dynamic_resolution and not FAMILY.takes_video
    assert FAMILY.preset_names() == ["gemma-3-tiny"]
    assert FAMILY.layout_class().__name__ == "Gemma3ImageLayout"
