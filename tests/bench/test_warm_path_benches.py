"""The warm path's CPU benchmarks (issue 65) run and report every case: bench.block_hash, bench.warm_input."""

from __future__ import annotations

import json

from bench import block_hash, warm_input


def test_block_hash_reports_both_hashings(tmp_path):
    out = tmp_path / "block_hash.json"
    payload = block_hash.main(["--blocks", "8", "--image-tokens", "64", "--images", "2", "--repeats", "2",
                               "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert results == payload["results"] and results["blocks"] == 8
    assert results["pickle_us_per_block"] > 0 and results["packed_us_per_block"] > 0


def test_warm_input_times_each_case(qwen_model_dir, tmp_path):
    out = tmp_path / "warm_input.json"
    warm_input.main(["--model", str(qwen_model_dir), "--repeats", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert len(results) == 4 and all(ms > 0 for ms in results.values())
