"""`mmserve up --model <qwen dir>`: encoder, decoder and gateway serve Qwen2.5-VL, and the official
`openai` client gets HF's tokens for an image sent as a data: URL (the gateway renders the checkpoint's
chat template, <|vision_start|><|image_pad|><|vision_end|> per image); a follow-up about the same image
from its cached prefix (tests/up_chat.py)."""

from __future__ import annotations

from tests.up_chat import check_up_answers_like_hf


def test_up_serves_qwen_to_the_openai_client(tmp_path, qwen_model_dir, qwen_oracle, qwen_images):
    check_up_answers_like_hf(tmp_path, qwen_model_dir, qwen_oracle, qwen_images[1],
                             ["What is in this picture?", "Describe its colours."])
