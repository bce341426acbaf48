"""A request's min_pixels below the checkpoint's is taken as HF's Qwen-VL processor and vLLM take it
(not refused), raised to one merged block at least; max_pixels stays within the server's cap."""

from __future__ import annotations

import pytest

from common.families.qwen2_5_vl.layout import load_qwen_layout
from common.image_geometry import ImageGeometryError


def test_min_pixels_below_the_checkpoints_is_taken(qwen_model_dir):
    layout = load_qwen_layout(qwen_model_dir)
    block = layout.factor * layout.factor
    lower = layout.min_pixels // 2
    assert block < lower < layout.min_pixels
    assert layout.pixel_range(lower).min_pixels == lower
    assert layout.pixel_range(1).min_pixels == block  # never below one merged block
    # A small image keeps its own size under the lower floor, as HF's smart_resize gives it.
    assert layout.grid(28, 28, layout.pixel_range(block)) == (1, 2, 2)
    assert layout.grid(28, 28, layout.pixel_range()) == (1, 4, 4)  # the checkpoint's floor scales it up
    with pytest.raises(ImageGeometryError, match="above the server's limit"):
        layout.pixel_range(0, layout.max_pixels + 1)
