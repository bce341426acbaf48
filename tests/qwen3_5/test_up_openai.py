"""`mmserve up --model <qwen3.5 dir>`: encoder, decoder and gateway serve the hybrid stack to the `openai`
client with HF's tokens; the follow-up question about the same image resumes from the prefix's KV blocks
and linear-state snapshot (tests/up_chat.py)."""

from __future__ import annotations

from tests.up_chat import check_up_answers_like_hf


def test_up_serves_qwen3_5_and_a_follow_up_resumes_from_the_snapshot(tmp_path, qwen3_5_model_dir,
                                                                       qwen3_5_oracle, qwen_images):
    check_up_answers_like_hf(tmp_path, qwen3_5_model_dir, qwen3_5_oracle, qwen_images[1],
                             ["What is in this picture?", "And what colour is it mostly?"])
