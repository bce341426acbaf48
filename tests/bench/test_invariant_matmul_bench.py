"""bench.invariant_matmul runs end to end on tiny shapes in Triton's interpreter (a smoke run: the timings
are the CPU's wall clock) and reports every (shape, configuration, M) with its rows the same bits."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from bench import invariant_matmul as bench  # noqa: E402


def test_every_configuration_and_row_count_is_reported_with_its_rows_invariant(tmp_path):
    out = tmp_path / "invariant_matmul.json"
    payload = bench.main(["--device", "cpu", "--shapes", "40x48,24x600", "--rows", "1,5", "--sweep",
                          "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert len(results) == len(payload["results"])
    configs = {(r["matrix"], r["config"]) for r in results}
    assert ("40x48", "default") in configs and ("24x600", "default") in configs
    assert len(configs) > 2  # the sweep's tile shapes beside the default
    assert {r["m"] for r in results} == {1, 5}
    assert all(r["rows_invariant"] and r["invariant_us"] > 0 and r["torch_us"] > 0 for r in results)
    sums = payload["sums"]
    assert {s["m"] for s in sums} == {1, 5} and all(s["rows_invariant"] for s in sums)


def test_shapes_are_a_preset_or_n_by_k():
    assert [s[0] for s in bench.parse_shapes("qwen3-vl-8b")] == ["o", "qkv", "gate_up", "down"]
    assert bench.parse_shapes("64x32,8X16") == [("64x32", 64, 32), ("8X16", 8, 16)]
