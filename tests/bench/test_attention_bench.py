"""bench.attention without a GPU: every candidate it would time (key tile, splits) runs in Triton's
interpreter and equals the torch reference, on a small family shape; the case arithmetic it reports."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bench import attention  # noqa: E402


def test_every_candidate_equals_the_reference(monkeypatch):
    monkeypatch.setitem(attention.FAMILIES, "tiny", (4, 2, 16))
    case = attention.Case("tiny", batch=3, context=40)
    tiles = attention.candidate_tiles((16, 32), (4,), (2,))
    row = attention.measure_case(case, tiles, torch.device("cpu"), dtype=torch.float32)
    assert row["kv_bytes"] == 3 * 40 * 2 * 16 * 2 * 4
    assert row["default_ref_err"] < 1e-4
    splits = {c["splits"] for c in row["candidates"]}
    assert row["default_splits"] in splits and 1 in splits
    assert len(row["candidates"]) == len(tiles) * len(splits)
    assert {t.heads_first for t in tiles} == {True, False}
    for c in row["candidates"]:
        assert c["ref_err"] < 1e-4 and c["err"] < 1e-4, c


def test_kv_copies_cover_the_l2_within_bounds():
    l2 = 50 << 20
    assert attention._copies(1 << 10, l2) == 64  # tiny: capped
    assert attention._copies(2 << 30, l2) == 4  # huge: the floor
    assert attention._copies(10 << 20, l2) == 15
    assert attention.Case("llava-1.5-7b", 32, 4096).kv_bytes(2) == 32 * 4096 * 32 * 128 * 2 * 2
