"""bench.moe_tiling on CPU through Triton's interpreter (tests/conftest.py sets it up): every tiling asked for
is timed at each token count, the best is one of them, the default tiling's parts and the dense reference are
there, and the useful FLOPs are counted from the shapes. Counts and structure, not speeds."""

from __future__ import annotations

import json

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter smoke run is for CPU hosts (tests/gpu runs the kernels)",
                allow_module_level=True)
pytest.importorskip("triton")

from bench import moe_tiling  # noqa: E402


def test_every_tiling_is_timed_and_the_parts_are_reported(tmp_path):
    out = tmp_path / "tiling.json"
    moe_tiling.main(["--device", "cpu", "--dtype", "float32", "--experts", "4", "--hidden", "32",
                     "--width", "16", "--top-k", "2", "--tokens", "3,70",
                     "--configs", "16x16x16/4w1s,32x16x16/4w1s,gemv8x16/4w+combine", "--routings", "2",
                     "--repeats", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in rows] == [3, 70]
    # the GEMVs only where choose_config would measure them (a few tokens)
    assert set(rows[0]["tilings"]) == {"16x16x16/4w1s", "32x16x16/4w1s", "gemv8x16/4w+combine"}
    assert set(rows[1]["tilings"]) == {"16x16x16/4w1s", "32x16x16/4w1s"}
    for row in rows:
        assert 1 <= row["experts_hit"] <= 4
        assert row["expert_mb"] == round(row["experts_hit"] * 3 * 32 * 16 * 4 / 1e6, 1)
        assert all(t["weight_tb_s"] >= 0 for t in row["tilings"].values())  # tiny on the interpreter
        assert row["best"] in row["tilings"]
        assert row["useful_gflop"] == round(2 * row["tokens"] * 2 * 3 * 32 * 16 / 1e9, 3)
        assert set(row["default_parts_us"]) == {"sort", "gate_up", "down", "combine"}
        assert row["dense_reference"]["us"] > 0
        assert row["grouped_mm"]["us"] > 0  # torch's grouped GEMM on fp32 experts (its CPU loop here)
        assert all(t["rows_allocated_per_row"] >= 1 for t in row["tilings"].values())
    assert rows[1]["default"] == "64x128x64/4w4s"  # default_config beyond the decode sizes


def test_a_tiling_is_parsed_and_named_back():
    config = moe_tiling.parse_config("64x128x64/8w3s")
    assert (config.block_m, config.block_n, config.block_k) == (64, 128, 64)
    assert (config.num_warps, config.num_stages) == (8, 3)
    assert moe_tiling.config_name(config) == "64x128x64/8w3s"
    with pytest.raises(Exception, match="expected BMxBNxBK"):
        moe_tiling.parse_config("64x128/8w")
    gemv = moe_tiling.parse_config("gemv8x256/4w+combine")
    assert (gemv.block_n, gemv.block_k, gemv.num_warps, gemv.fuse_combine) == (8, 256, 4, True)
    assert moe_tiling.config_name(gemv) == "gemv8x256/4w+combine"
    assert moe_tiling.config_name(moe_tiling.parse_config("gemv16x512/8w")) == "gemv16x512/8w"
    with pytest.raises(Exception, match="gemvBNxBK"):
        moe_tiling.parse_config("gemv8x256/4w+sum")
    swapped = moe_tiling.parse_config("16x64x128/4w4s+swap")
    assert swapped.swap_ab and moe_tiling.config_name(swapped) == "16x64x128/4w4s+swap"
    tma = moe_tiling.parse_config("tma16st6w4")
    assert (tma.block_n, tma.stages, tma.warps) == (16, 6, 4)
    assert moe_tiling.config_name(tma) == "tma16st6w4"
