"""The load generator speaks each family's prompt format: against a Qwen-VL pair its requests carry
Qwen's vision tokens (with LLaVA's `<image>` every one of them was refused)."""

from __future__ import annotations

import json

from bench import serve
from bench.workload import QWEN_IMAGE, PromptMaker, build_requests


def test_qwen_prompts_carry_the_vision_tokens(qwen_model_dir, tiny_model_dir):
    qwen, llava = PromptMaker(qwen_model_dir), PromptMaker(tiny_model_dir)
    req = build_requests(2, 0.0, 8, qwen, image_size=32, shared_len=4)[0]
    assert req.prompt.count(QWEN_IMAGE) == 1 and req.prompt.startswith("<|im_start|>user\n")
    assert build_requests(1, 0.0, 8, llava, image_size=32)[0].prompt.startswith("USER: <image>\n")


def test_bench_serve_against_a_qwen_pair(qwen_model_dir, tmp_path):
    out = tmp_path / "serve.json"
    code = serve.main(["--spawn", "--model", str(qwen_model_dir), "--num-requests", "4", "--concurrency", "2",
                       "--output-len", "3", "--image-size", "48", "--out", str(out), "--no-progress"])
    summary = json.loads(out.read_text())["results"]
    assert code == 0 and summary["completed"] == 4 and summary["failed"] == 0
