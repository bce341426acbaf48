"""Our Qwen3-VL ViT (common/families/qwen3_vl/tower.py) equals HF's get_image_features in fp32 on a CPU: the
merged features and every DeepStack level, max abs diff 0, one image or several sizes in one forward."""

from __future__ import annotations

import pytest
import torch

from common.checkpoint import load_config
from common.families.qwen3_vl.tower import Qwen3VisionTower, load_qwen3_tower, position_taps
from tests.oracle import make_image


@pytest.fixture(scope="module")
def tower(qwen3_model_dir):
    return load_qwen3_tower(qwen3_model_dir, load_config(qwen3_model_dir)["vision_config"])


def _ours(tower, pixel_values, grids) -> list[torch.Tensor]:
    rows = [tower.num_rows(g) for g in grids.tolist()]
    with torch.no_grad():
        return tower(pixel_values, [tuple(g) for g in grids.tolist()]).split(rows)


def _assert_equal(ours: list[torch.Tensor], refs: list[torch.Tensor], parts: int) -> None:
    assert len(ours) == len(refs)
    for mine, ref in zip(ours, refs, strict=True):
        assert ref.shape[0] == parts == mine.shape[0]
        assert mine.shape == ref.shape
        for part in range(parts):  # merged first, then each DeepStack level
            diff = (mine[part] - ref[part]).abs().max().item()
            assert diff == 0.0, f"part {part}: max abs diff {diff}"


def test_one_image(tower, qwen3_oracle, qwen_images):
    pixel_values, grids = qwen3_oracle.pixels(qwen_images[:1])
    assert tower.parts == 4  # merged + deepstack_visual_indexes [0, 1, 2]
    _assert_equal(_ours(tower, pixel_values, grids), qwen3_oracle.image_features(pixel_values, grids), 4)


def test_three_sizes_in_one_forward(tower, qwen3_oracle, qwen_images):
    """224x224, 640x480 and 1000x300 (grids 16x16, 30x40, 18x62) batched in one forward, as HF batches."""
    pixel_values, grids = qwen3_oracle.pixels(qwen_images)
    assert grids.tolist() == [[1, 16, 16], [1, 30, 40], [1, 18, 62]]
    ours = _ours(tower, pixel_values, grids)
    _assert_equal(ours, qwen3_oracle.image_features(pixel_values, grids), 4)
    assert [o.shape[1] for o in ours] == [64, 300, 279]


def test_equal_sizes_share_one_attention_call(tower, qwen3_oracle, qwen_images):
    """Two images of one size go through attention as one batch of two chunks: still HF's numbers."""
    images = [qwen_images[0], make_image(21, (224, 224)), qwen_images[2]]
    pixel_values, grids = qwen3_oracle.pixels(images)
    _assert_equal(_ours(tower, pixel_values, grids), qwen3_oracle.image_features(pixel_values, grids), 4)


def test_stacked_layout(tower, qwen3_oracle, qwen_images):
    pixel_values, grids = qwen3_oracle.pixels(qwen_images[:2])
    with torch.no_grad():
        features = tower(pixel_values, [tuple(g) for g in grids.tolist()])
    stacked = features.stacked()
    assert stacked.shape == (4, 64 + 300, 64)
    assert torch.equal(stacked[0], features.merged)
    assert all(torch.equal(stacked[k + 1], level) for k, level in enumerate(features.deepstack))
    assert not torch.equal(stacked[1], stacked[2])  # the levels are distinct outputs


def test_patch_embedding_as_matrix_product(tower, qwen3_oracle, qwen_images):
    """The GPU's path (one matrix product instead of the Conv3d) sums in another order: on a CPU in fp32
    it stays within 1e-4 of HF's (relative to outputs of size ~4), not bit-equal."""
    pixel_values, grids = qwen3_oracle.pixels(qwen_images)
    refs = qwen3_oracle.image_features(pixel_values, grids)
    tower.patch_as_linear = True
    try:
        ours = _ours(tower, pixel_values, grids)
    finally:
        tower.patch_as_linear = None
    worst = max((o - r).abs().max().item() for o, r in zip(ours, refs, strict=True))
    assert worst < 1e-4


def test_position_taps_equal_transformers():
    """The bilinear resampling of the learned position table: HF's indices and weights, bit for bit."""
    vision_utils = pytest.importorskip("transformers.vision_utils")
    grids = [(1, 16, 16), (1, 30, 40), (1, 18, 62), (2, 4, 2)]
    tower = Qwen3VisionTower(dict(hidden_size=32, num_heads=2, intermediate_size=8, depth=1,
                                  out_hidden_size=8, num_position_embeddings=144))
    positions, sizes, _ = tower.layout(grids)
    indices, weights = position_taps(positions, sizes, 12)
    ref_i, ref_w = vision_utils.get_vision_interpolation_indices_and_weights(
        torch.tensor(grids), num_grid_per_side=12, mode="bilinear", align_corners=True, spatial_merge_size=2)
    assert torch.equal(indices, ref_i)
    assert torch.equal(weights, ref_w)


def test_deepstack_index_outside_depth_refused():
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        Qwen3VisionTower(dict(hidden_size=32, num_heads=2, intermediate_size=8, depth=2, out_hidden_size=8,
                              deepstack_visual_indexes=[2]))


def test_the_gelu_epilogue_computes_the_mlp_activation():
    """Off a GPU (and for an FP8 layer) the fused ops' fc1 + GELU is HF's order: the product, then the tanh
    GELU (torch's CPU _addmm_activation would apply the erf one). The GPU's epilogue:
    tests/gpu/test_vision_fast_path_gpu.py."""
    from torch import nn

    from common.families.qwen3_vl.tower import linear_gelu_tanh, linear_gelu_tanh_epilogue
    from common.vision.fp8 import Fp8VisionLinear

    torch.manual_seed(0)
    fc1, x = nn.Linear(32, 48), torch.randn(20, 32)
    assert torch.equal(linear_gelu_tanh_epilogue(x, fc1), linear_gelu_tanh(x, fc1))
    exact_gelu = torch.nn.functional.gelu(fc1(x))  # not the tanh form: the two differ
    assert not torch.allclose(linear_gelu_tanh(x, fc1), exact_gelu, rtol=0, atol=1e-7)
    fp8 = Fp8VisionLinear.from_linear(fc1)
    assert torch.equal(linear_gelu_tanh_epilogue(x, fp8), linear_gelu_tanh(x, fp8))
