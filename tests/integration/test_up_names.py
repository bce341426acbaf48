"""`mmserve up --model X` serves X under the name the user typed, as `vllm serve X` does: a directory as
typed (and its folder's name too), or a Hub id (here through an offline Hugging Face cache laid out by
the test)."""

from __future__ import annotations

import shutil
import signal

from tests.hub_cache import lay_out_hub_cache
from tests.integration.harness import kill_group, start_up


def _up_and_ask(tmp_path, model: str, name: str, env_extra: dict[str, str], listed: list[str] | None = None
                ) -> str:
    """Run `mmserve up --model model`, call the official client with model=name; /v1/models lists
    `listed` (default: [name]) and replies carry its first; returns up's log."""
    from openai import OpenAI

    up, log_path, gateway_port = start_up(tmp_path, model, env_extra)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="-", max_retries=0)
        models = client.models.list().data
        listed = listed or [name]
        assert [m.id for m in models] == listed
        reply = client.chat.completions.create(model=name, max_tokens=3, temperature=0,
                                               messages=[{"role": "user", "content": "Hello"}])
        assert reply.model == listed[0] and reply.usage.completion_tokens >= 1
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        return log_path.read_text()
    finally:
        kill_group(up)


def test_up_serves_a_directory_under_its_name(tmp_path, tiny_model_dir):
    model = tmp_path / "my-llava"
    shutil.copytree(tiny_model_dir, model)
    log = _up_and_ask(tmp_path, str(model), "my-llava", {}, listed=[str(model), "my-llava"])
    assert f"mmserve is up: '{model}'" in log and "on cpu in float32" in log
    assert "--chat" in log  # the printed next step


def test_up_serves_a_hub_id_under_the_hub_id(tmp_path, tiny_model_dir):
    cache = tmp_path / "hub"
    lay_out_hub_cache(tiny_model_dir, cache, "llava-hf/my-llava")
    log = _up_and_ask(tmp_path, "llava-hf/my-llava", "llava-hf/my-llava",
                      {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert "'llava-hf/my-llava'" in log
