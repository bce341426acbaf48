"""bench.merge: payloads that carry their own `headline` (bench.qwen_gpu for Qwen2.5-VL and Qwen3-VL,
bench.qwen_serve) have their rows in the merged table, beside the rows picked from known benchmarks."""

from __future__ import annotations

import json

from bench import merge


def _write(path, name, **extra):
    path.write_text(json.dumps({"benchmark": name, "config": {}, "results": {}, **extra}))
    return str(path)


def test_payload_headlines_are_merged(tmp_path):
    q3 = [["qwen3 tower img/s (ours b1 / b8)", "3 / 4"], ["qwen3 greedy agreement with HF", "1.0"]]
    q25 = [["qwen tower img/s (ours b1 / b8)", "1 / 2"]]
    serve = [["qwen3 lookahead mean TTFT on/off", 0.8]]
    files = [
        _write(tmp_path / "qwen_gpu.json", "qwen_gpu", headline=q25),
        _write(tmp_path / "qwen3_gpu.json", "qwen3_gpu", headline=[*q3, ["malformed row"], "not a row"]),
        _write(tmp_path / "qwen3_serve.json", "qwen3_serve", headline=serve),
        _write(tmp_path / "ttft_prefix.json", "ttft_prefix", headline=[["never shown: a fixed benchmark", 0]],
               results={"cold": {"p50_ms": 10.0}}),
        _write(tmp_path / "plain.json", "plain"),
    ]
    merged = merge.merge(files)
    assert list(merged["benchmarks"]) == ["qwen_gpu", "qwen3_gpu", "qwen3_serve", "ttft_prefix", "plain"]
    rows = merged["headline"]
    assert ["TTFT cold p50 ms", 10.0] in rows
    assert rows[-4:] == [*q25, *q3, *serve]
    assert not any(r[0].startswith("never shown") for r in rows)
