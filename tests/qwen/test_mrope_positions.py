"""M-RoPE positions of images on non-square grids, where swapping an image's height and width positions
shows (square test images and the tiny presets' parity runs do not show it).

HF's rule (get_rope_index of Qwen2.5-VL and Qwen3-VL): text tokens take the same position on all three
axes, counting on; an image of merged grid gh x gw starting at position s lays its tokens out row-major,
token k at (temporal s, height s + k // gw, width s + k % gw); the text after it continues at
s + max(gh, gw)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.families.qwen2_5_vl.layout import mrope_positions

USER, END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
WIDE_THEN_TALL = (USER + "<|vision_start|><|image_pad|><|vision_end|>wide, then "
                  "<|vision_start|><|image_pad|><|vision_end|> tall" + END)


def test_hand_computed_wide_and_tall_images():
    """Three text tokens, a 2x3 (merged) wide image, two text tokens, a 3x2 tall image, one text token."""
    wide, tall = (1, 4, 6), (1, 6, 4)  # (t, h, w) patches; merged by 2: 2x3 and 3x2
    positions, delta = mrope_positions(3 + 6 + 2 + 6 + 1, [(3, wide), (11, tall)], merge_size=2)
    # text 0..2 | wide image from 3 | text from 3 + max(2, 3) = 6 | tall image from 8 | text from 8 + 3
    expected_t = [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 8, 8, 8, 8, 8, 11]
    expected_h = [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 8, 9, 9, 10, 10, 11]
    expected_w = [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 8, 9, 8, 9, 11]
    assert positions.tolist() == [expected_t, expected_h, expected_w]
    assert delta == 12 - 18  # generated token i (0-based, after the prompt) is at 18 + i + delta = 12 + i


def _by_hand(types: list[int], grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """HF's rule (module docstring) over a prompt whose image tokens are marked 1 in `types`."""
    out, pos, i, grids_left = [], 0, 0, iter(grids)
    while i < len(types):
        if not types[i]:
            out.append((pos, pos, pos))
            pos, i = pos + 1, i + 1
            continue
        _, h, w = next(grids_left)
        gh, gw = h // merge, w // merge
        out += [(pos, pos + k // gw, pos + k % gw) for k in range(gh * gw)]
        pos, i = pos + max(gh, gw), i + gh * gw
    return np.array(out).T


@pytest.fixture(params=["qwen2.5", "qwen3"])
def family(request):
    """(engine, HF oracle) of each family's tiny preset."""
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource

    name = "qwen" if request.param == "qwen2.5" else "qwen3"
    config = EngineConfig(model=request.getfixturevalue(f"{name}_model_dir"), num_kv_blocks=64)
    oracle = request.getfixturevalue(f"{name}_oracle")
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config)), oracle


def test_wide_and_tall_images_take_hfs_positions(family):
    """A 140x56 (wide) and a 56x112 (tall) image in one prompt: the request's positions equal the rule
    worked by hand over HF's own tokens and grids, and HF's get_rope_index."""
    from tests.oracle import greedy, make_image

    engine, oracle = family
    images = [make_image(21, (56, 140)), make_image(22, (112, 56))]  # (height, width)
    inputs = oracle.inputs(WIDE_THEN_TALL, images)
    grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]
    merge = oracle.model.config.vision_config.spatial_merge_size
    (gh0, gw0), (gh1, gw1) = [(h // merge, w // merge) for _, h, w in grids]
    assert gh0 < gw0 and gh1 > gw1, grids  # one wide and one tall grid, as the case needs

    req = engine.add_request("r", WIDE_THEN_TALL, images, sampling=greedy(1))
    assert req.prompt_token_ids == inputs["input_ids"][0].tolist()
    types = inputs["mm_token_type_ids"][0].tolist()
    assert np.array_equal(req.mrope_positions, _by_hand(types, grids, merge))
    with torch.no_grad():
        hf_positions, hf_delta = oracle.model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
            attention_mask=inputs["attention_mask"])
    assert np.array_equal(req.mrope_positions, hf_positions[:, 0].numpy())
    assert req.mrope_delta == int(hf_delta.reshape(-1)[0])
    engine.abort("r")
