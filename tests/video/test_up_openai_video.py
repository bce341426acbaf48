"""`mmserve up --model <qwen3 dir>`: the official `openai` client sends a video as a `video_url` data: URL
(as vLLM's OpenAI server accepts it) and gets HF's tokens; the gateway renders the checkpoint's chat
template, the decoder lays the video out in timestamped groups, the encoder makes its DeepStack parts; the
request's mm_processor_kwargs (fps) sample it as HF does with that setting."""

from __future__ import annotations

import base64

from tests.integration.harness import running_up
from tests.video.test_engine_video import VIDEO, VideoOracle

N = 8


def test_up_serves_a_qwen3_video_to_the_openai_client(tmp_path, qwen3_model_dir, qwen3_oracle):
    from openai import OpenAI

    with running_up(tmp_path, str(qwen3_model_dir)) as (_, _, port):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        name = client.models.list().data[0].id
        url = "data:video/mp4;base64," + base64.b64encode(VIDEO).decode()
        content = [{"type": "video_url", "video_url": {"url": url}},
                   {"type": "text", "text": "What happens in this video?"}]
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": content}],
                                               max_tokens=N, temperature=0)
        oracle = VideoOracle(qwen3_oracle, qwen3_model_dir)
        chat = [{"role": "user", "content": [{"type": "video"},
                                             {"type": "text", "text": "What happens in this video?"}]}]
        text = oracle.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        expected = oracle.generate(text, [], [VIDEO], N)
        assert reply.usage.completion_tokens == N
        assert reply.choices[0].message.content == oracle.tokenizer.decode(expected, skip_special_tokens=True)
        # vLLM's mm_processor_kwargs: sampled at 4 fps instead of the model's 2, as HF samples it then.
        denser = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": content}], max_tokens=N, temperature=0,
            extra_body={"mm_processor_kwargs": {"fps": 4.0}})
        expected = VideoOracle(qwen3_oracle, qwen3_model_dir, fps=4.0).generate(text, [], [VIDEO], N)
        assert denser.usage.prompt_tokens > reply.usage.prompt_tokens
        wanted = oracle.tokenizer.decode(expected, skip_special_tokens=True)
        assert denser.choices[0].message.content == wanted
