"""`mmserve up --model <qwen3.5-moe dir>`: encoder, decoder and gateway serve the hybrid mixture-of-experts
stack to the `openai` client with HF's tokens, a follow-up about the same image resumed from its state
snapshot (tests/up_chat.py)."""

from __future__ import annotations

from tests.up_chat import check_up_answers_like_hf


def test_up_serves_qwen3_5_moe_to_the_openai_client(tmp_path, qwen3_5_moe_model_dir, qwen3_5_moe_oracle,
                                                    qwen_images):
    check_up_answers_like_hf(tmp_path, qwen3_5_moe_model_dir, qwen3_5_moe_oracle, qwen_images[1],
                             ["What is in this picture?", "And what colour is it mostly?"])
