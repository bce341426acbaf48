"""`mmserve up --model <qwen dir>`: encoder, decoder and gateway serve Qwen2.5-VL, and the official
`openai` client gets HF's tokens for an image sent as a data: URL (the gateway renders the checkpoint's
chat template, <|vision_start|><|image_pad|><|vision_end|> per image)."""

from __future__ import annotations

import base64

from common.images import encode_png
from tests.integration.harness import running_up

N = 8


def test_up_serves_qwen_to_the_openai_client(tmp_path, qwen_model_dir, qwen_oracle, qwen_images):
    from openai import OpenAI

    with running_up(tmp_path, str(qwen_model_dir)) as (_, _, port):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        name = client.models.list().data[0].id
        url = "data:image/png;base64," + base64.b64encode(encode_png(qwen_images[1])).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is in this picture?"}]}]
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=N, temperature=0,
                                               logprobs=True)
        hf_messages = [{"role": "user", "content": [{"type": "image"},
                                                    {"type": "text", "text": "What is in this picture?"}]}]
        expected = qwen_oracle.generate(qwen_oracle.chat_text(hf_messages), [qwen_images[1]], N)
        assert reply.usage.prompt_tokens > 391 and reply.usage.completion_tokens == N
        text = qwen_oracle.tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.choices[0].message.content == text
