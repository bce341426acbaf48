"""`mmserve up --model <gemma3 dir>`: encoder, decoder and gateway serve Gemma 3, and the official `openai`
client gets HF's tokens for two images sent as data: URLs (the gateway renders the checkpoint's chat
template, `<start_of_image>` per image part, and the tokenizer expands each into its block)."""

from __future__ import annotations

import base64

from common.families.oracle import greedy_new_tokens
from common.images import encode_png
from tests.gemma3.conftest import sample_images
from tests.integration.harness import running_up

N = 8


def test_up_serves_gemma3_to_the_openai_client(tmp_path, gemma3_tiny_dir, gemma3_oracle):
    from openai import OpenAI

    images = sample_images()[1:3]
    with running_up(tmp_path, str(gemma3_tiny_dir)) as (_, _, port):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        name = client.models.list().data[0].id
        urls = ["data:image/png;base64," + base64.b64encode(encode_png(i)).decode() for i in images]
        content = [{"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": urls[0]}},
                   {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": urls[1]}}]
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": content}],
                                               max_tokens=N, temperature=0)
        hf_messages = [{"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                                    {"type": "text", "text": "with"}, {"type": "image"}]}]
        inputs = gemma3_oracle.chat_inputs(hf_messages, images)
        expected = greedy_new_tokens(gemma3_oracle.model, inputs, N)
        assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
        assert reply.usage.completion_tokens == N
        assert reply.choices[0].message.content == gemma3_oracle.tokenizer.decode(expected,
                                                                                   skip_special_tokens=True)
