"""bench.vision_attention without a GPU: the Triton kernel and every tile it would sweep run in Triton's
interpreter and equal the fp32 reference on a small case; the cases' layouts and FLOP counts; its random
towers are HF's towers on the same weights (exactly, fp32 on the CPU) and its tower figures come out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from bench import vision_attention as bench  # noqa: E402
from common.kernels.vision_attention import Tiles  # noqa: E402

TINY = {"qwen3-vl-8b": dict(depth=2, hidden_size=144, num_heads=2, intermediate_size=64,  # head dim 72
                            deepstack_visual_indexes=[0], out_hidden_size=32, num_position_embeddings=64),
        "qwen2.5-vl-7b": dict(depth=2, hidden_size=160, num_heads=2, intermediate_size=64,  # head dim 80
                              fullatt_block_indexes=[1], out_hidden_size=32)}


def test_every_candidate_equals_the_reference():
    case = bench.Case("tiny", 72, (0, 40, 40, 100), heads=2)
    tiles = [Tiles(32, 16, 4, 2), Tiles(16, 32, 4, 2)]
    row = bench.measure_case(case, torch.device("cpu"), torch.float32, tiles)
    assert row["gflop"] == pytest.approx(4 * (40**2 + 60**2) * 72 * 2 / 1e9)
    assert set(row["backends"]) == {"triton"}  # torch's kernels are timed on CUDA only
    assert row["backends"]["triton"]["err"] < 1e-5 and "ms" not in row["backends"]["triton"]
    assert len(row["sweep"]) == len(tiles)
    for entry in row["sweep"]:
        assert entry["err"] < 1e-5, entry


def test_the_cases_have_the_real_layouts():
    cases = {c.name: c for c in bench.default_cases([1, 8])}
    assert cases["image4096_hd72"].flops == 4 * 4096**2 * 72 * 16
    assert cases["qwen3vl_b8"].bounds == tuple(range(0, 8 * 4096 + 1, 4096)) and cases["qwen3vl_b8"].uniform
    full = cases["qwen25vl_full_b1"]
    assert full.bounds == (0, 4900) and full.head_dim == 80
    windows = cases["qwen25vl_window_b8"]
    lengths = bench.window_lengths(70)
    assert lengths.sum() == 4900 and lengths.max() == 64 and not windows.uniform
    assert windows.bounds[-1] == 8 * 4900 and len(windows.bounds) == 8 * len(lengths) + 1
    assert windows.flops == 8 * 4 * int((lengths**2).sum()) * 80 * 16
    assert len(bench.candidate_tiles()) == 16


@pytest.mark.parametrize("preset", sorted(TINY))
def test_random_tower_is_hf_tower_on_the_same_weights(preset):
    from bench.vision_path import hf_tower_from_state

    tower, vision = bench.random_tower(preset, torch.device("cpu"), torch.float32, **TINY[preset])
    if preset.startswith("qwen3"):
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
    hf = hf_tower_from_state(Config(**vision), tower.state_dict(), torch.device("cpu"), torch.float32)
    pixels = torch.randn(2 * 8 * 8, tower.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = tower(pixels, [(1, 8, 8)] * 2)
        theirs = hf(pixels, grid_thw=torch.tensor([[1, 8, 8]] * 2)).pooler_output
    ours = ours if isinstance(ours, torch.Tensor) else ours.merged
    assert torch.equal(ours, theirs)


def test_tower_figures_on_the_cpu():
    out = bench.tower_figures("qwen2.5-vl-7b", torch.device("cpu"), torch.float32, [1, 2], rounds=1, hf=True,
                              side=8, **TINY["qwen2.5-vl-7b"])
    assert out["head_dim"] == 80 and out["grid"] == [1, 8, 8]
    for kernel in ("sdpa", "triton"):
        for b in (1, 2):
            assert out[f"{kernel}_b{b}_images_per_s"] > 0 and out[f"{kernel}_over_hf_b{b}"] > 0
    assert out["triton_b2_err_vs_sdpa"] == 0  # the CPU runs the reference path whatever the switch says
    assert out["hf"]["b2_images_per_s"] > 0
    rows = bench.headline([], [out])
    assert any(name.endswith("triton_b2_images_per_s") for name, _ in rows)
    assert np.isfinite([value for _, value in rows]).all()
