"""bench.deterministic_cost on qwen2.5-vl-tiny, CPU: both modes measured through real pairs, every figure
present, and the mode's reference repeating bit for bit after the load. Starts services: slow."""

from __future__ import annotations

import json

from bench import deterministic_cost


def test_both_modes_measured_and_the_reference_repeats(qwen_model_dir, tmp_path):
    out = tmp_path / "cost.json"
    rc = deterministic_cost.main(["--model", str(qwen_model_dir), "--streams", "1,3", "--output-len", "8",
                                  "--prompt-len", "16", "--encode-clients", "3", "--images", "6",
                                  "--cold-images", "2", "--image-size", "64",
                                  "--logs", str(tmp_path / "logs"), "--out", str(out)])
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "deterministic_cost"
    res = payload["results"]
    assert rc == 0 and res["on"]["reference_repeats"] is True
    for mode in ("off", "on"):
        for figure in ("decode_tok_s_1", "decode_tok_s_3", "encode_img_s", "cold_ttft_ms"):
            assert res[mode][figure] > 0, (mode, figure)
    assert set(res["cost"]) == {"decode_tok_s_1", "decode_tok_s_3", "encode_img_s", "cold_ttft_ms"}
