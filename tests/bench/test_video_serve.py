"""bench.video_serve on qwen2.5-vl-tiny, CPU: tiny clips through one encoder and two decoders (lookahead 4
and 0) and HF's reference; the JSON has its headline rows. Starts services: slow (about 40 s on 2 cores).
Speed is not checked."""

from __future__ import annotations

import json

import pytest

from bench import video_serve

pytestmark = pytest.mark.slow

ROWS = ("qwen video clip: 2 s 8 fps 64px, sampled frames / grid / tokens", "qwen video TTFT cold / warm ms",
        "qwen video HF vision+prefill ms / host decode+patches ms",
        "qwen video lookahead mean TTFT ms (on / off)", "qwen video lookahead on/off mean TTFT")


def test_video_serve_cpu(qwen_model_dir, tmp_path):
    out = tmp_path / "video.json"
    rc = video_serve.main(["--model", str(qwen_model_dir), "--device", "cpu", "--dtype", "float32",
                           "--clips", "2", "--clip-seconds", "2", "--clip-fps", "8", "--clip-size", "64",
                           "--ttft-rounds", "2", "--requests", "2", "--arrival-interval", "0.1",
                           "--output-len", "4", "--hf", "--logs", str(tmp_path / "logs"), "--out", str(out)])
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text
    payload = json.loads(text)
    assert rc == 0, payload["results"]
    assert payload["benchmark"] == "qwen_video" and payload["env"]["device"] == "cpu"
    headline = dict(payload["headline"])
    assert set(ROWS) <= headline.keys() and all(headline[r] is not None for r in ROWS), headline
    res = payload["results"]
    # 2 s at 8 fps sampled at the model's 2 fps: 4 frames, 2 temporal groups of 64x64 (4x4 patches)
    assert res["clips"]["sampled_frames"] == 4 and res["clips"]["grid_thw"] == [2, 4, 4]
    assert res["clips"]["tokens"] == 8
    for r in res["ttft"]["rounds"]:  # the repeat reuses the prefix KV (blocks of 16 tokens)
        assert r["warm_cached_prompt_tokens"] == (r["prompt_tokens"] - 1) // 16 * 16 > 0
    assert res["hf"]["prompt_tokens"] == [r["prompt_tokens"] for r in res["ttft"]["rounds"]]
    for name in ("on", "off"):
        la = res["lookahead"][name]
        assert la["n"] == 2 and la["missing"] == 0 and la["stats"]["requests_finished"] == 2
    assert res["lookahead"]["mean_on_over_off"] > 0
