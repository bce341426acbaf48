"""`mmserve up` serving a Qwen-chat family to the official `openai` client: each question about one image
(sent as a data: URL; the gateway renders the checkpoint's chat template) gets HF's greedy tokens, and
every question after the first finds the prompt's prefix up to the image's end cached (the KV blocks, and
on a hybrid stack the linear layers' state snapshot there), reported as cached tokens."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from PIL import Image

from common.images import encode_png
from tests.integration.harness import running_up


def _messages(image_part: dict, question: str) -> list[dict]:
    return [{"role": "user", "content": [image_part, {"type": "text", "text": question}]}]


def check_up_answers_like_hf(tmp_path: Path, model_dir: Path, oracle: Any, image: Image.Image,
                             questions: list[str], n: int = 8) -> None:
    """Start `mmserve up` on model_dir, ask each question about `image` in turn (greedy, n tokens) and
    check the answers, token counts and cached tokens against `oracle` (chat_text, inputs, generate)."""
    from openai import OpenAI

    url = "data:image/png;base64," + base64.b64encode(encode_png(image)).decode()
    with running_up(tmp_path, str(model_dir)) as (_, _, port):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        name = client.models.list().data[0].id
        for i, question in enumerate(questions):
            reply = client.chat.completions.create(
                model=name, messages=_messages({"type": "image_url", "image_url": {"url": url}}, question),
                max_tokens=n, temperature=0)
            prompt = oracle.chat_text(_messages({"type": "image"}, question))
            expected = oracle.generate(prompt, [image], n)
            assert reply.choices[0].message.content == oracle.tokenizer.decode(
                expected, skip_special_tokens=True), question
            assert reply.usage.prompt_tokens == oracle.inputs(prompt, [image])["input_ids"].shape[1]
            assert reply.usage.completion_tokens == n
            cached = reply.usage.prompt_tokens_details.cached_tokens or 0
            assert (cached > 0) == (i > 0), (question, cached)
