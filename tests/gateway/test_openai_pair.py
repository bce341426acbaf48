"""The official OpenAI client against a real gateway in front of a real pair on the tiny model."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench.services import free_port
from common.client import DecoderClient
from common.images import encode_png
from tests.gateway.conftest import KEY_A, KEY_B, openai_client
from tests.gateway.harness import GatewayProcess, ImageServer, data_url
from tests.integration.harness import Service
from tests.oracle import make_image

QUESTION = "What is in this picture? Describe it with care, colour by colour, shape by shape."
N = 12


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [encode_png(make_image(seed, (40, 52))) for seed in (21, 22, 23)]


def chat_messages(url: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def grpc_chat(pair, png: bytes, text: str = QUESTION, max_tokens: int = N, **kwargs):
    """The same chat sent straight to the decoder over gRPC, greedy."""
    with pair.decoder_client() as dec:
        content = [{"type": "image", "image": png}, {"type": "text", "text": text}]
        return dec.generate_text(chat=[{"role": "user", "content": content}], max_tokens=max_tokens, **kwargs)


def token_ids(logprobs_content) -> list[int]:
    """Token ids from logprobs of a gateway without a tokenizer (`token_id:N`)."""
    return [int(entry.token.removeprefix("token_id:")) for entry in logprobs_content]


def test_models_and_health(gateway, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(f"{gateway.url}/health", timeout=10) as reply:
        assert reply.status == 200


def test_chat_with_data_url_image_equals_direct_grpc(pair, client, images):
    direct = grpc_chat(pair, images[0], cache_salt="parity-grpc")
    reply = client.chat.completions.create(model="tiny", messages=chat_messages(data_url(images[0])),
                                           max_tokens=N, temperature=0, logprobs=True)
    choice = reply.choices[0]
    assert token_ids(choice.logprobs.content) == direct.token_ids
    assert choice.message.content == direct.text and choice.message.role == "assistant"
    assert choice.finish_reason == direct.finish_reason.lower()
    assert reply.usage.prompt_tokens == direct.usage.prompt_tokens
    assert reply.usage.completion_tokens == len(direct.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == "tiny" and reply.id.startswith("chatcmpl-")


def test_streamed_chat_equals_the_whole_one_and_reports_usage_last(pair, client, images):
    direct = grpc_chat(pair, images[1])
    stream = client.chat.completions.create(
        model="tiny", messages=chat_messages(data_url(images[1])), max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=3)
    chunks = list(stream)  # ends cleanly at `data: [DONE]`
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].logprobs]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = token_ids([e for c in content for e in c.choices[0].logprobs.content])
    assert ids == direct.token_ids and text == direct.text
    top = content[0].choices[0].logprobs.content[0]
    assert len(top.top_logprobs) == 3 and top.top_logprobs[0].logprob >= top.top_logprobs[1].logprob
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [direct.finish_reason.lower()]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(direct.token_ids)
    assert last.usage.prompt_tokens == direct.usage.prompt_tokens


def test_repeat_reports_cached_tokens_only_within_a_tenant(pair, gateway, images):
    messages = chat_messages(data_url(images[2]))
    a, b = openai_client(gateway, KEY_A), openai_client(gateway, KEY_B)
    first = a.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    second = a.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    other_tenant = b.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    block_size = 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - block_size > 0
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0  # another key: another cache
    assert second.choices[0].message.content == first.choices[0].message.content
    # X-Cache-Salt splits one tenant's cache further.
    split = a.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                      extra_headers={"X-Cache-Salt": "project-x"})
    assert split.usage.prompt_tokens_details.cached_tokens == 0


def test_text_completion_equals_direct_grpc(pair, client):
    prompt = "USER: Tell me a story about a red car. ASSISTANT:"
    with pair.decoder_client() as dec:
        direct = dec.generate_text(prompt, max_tokens=N)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0, logprobs=2)
    assert reply.choices[0].text == direct.text
    assert [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens] == direct.token_ids
    assert reply.usage.completion_tokens == len(direct.token_ids)
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct.text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="USER: <image>\nhi ASSISTANT:", max_tokens=2)
    assert err.value.body["param"] == "prompt"


def test_stop_and_seeded_sampling_pass_through(pair, client):
    prompt = "USER: Tell me a story about a blue boat. ASSISTANT:"
    with pair.decoder_client() as dec:
        seeded = dec.generate_text(prompt, max_tokens=N, temperature=0.9, top_p=0.95, seed=1234)
        greedy = dec.generate_text(prompt, max_tokens=N)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0.9, top_p=0.95,
                                      seed=1234)
    assert reply.choices[0].text == seeded.text
    stop = greedy.text[len(greedy.text) // 2:][:3]
    if stop.strip():  # a stop string from the greedy text itself ends the output before it
        stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=N, temperature=0,
                                            stop=[stop])
        assert stopped.choices[0].finish_reason == "stop"
        assert stop not in stopped.choices[0].text and greedy.text.startswith(stopped.choices[0].text)


def test_http_image_url_from_a_local_server_and_its_errors(pair, open_gateway, images):
    client = openai_client(open_gateway)
    big = b"\x89PNG" + bytes(200_000)  # over the gateway's --max-image-bytes 100000
    with ImageServer({"cat.png": images[0], "big.png": big}) as server:
        direct = grpc_chat(pair, images[0])
        for url in (f"{server.url}/cat.png", f"{server.url}/redirect/cat.png"):
            reply = client.chat.completions.create(model="tiny", messages=chat_messages(url), max_tokens=N,
                                                   temperature=0, logprobs=True)
            assert reply.choices[0].message.content == direct.text
            # With --model, logprob tokens are the tokenizer's text pieces (not `token_id:N`), one a token.
            content = reply.choices[0].logprobs.content
            assert len(content) == len(direct.token_ids)
            assert not any(e.token.startswith("token_id:") for e in content)
            assert any(e.token and e.token in direct.text for e in content)
        for path, code in (("big.png", "image_too_large"), ("missing.png", "image_fetch_failed")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=chat_messages(f"{server.url}/{path}"),
                                               max_tokens=2)
            assert err.value.body["code"] == code
            assert err.value.body["param"] == "messages.0.content.0.image_url"


def test_private_image_url_is_refused_by_default(gateway, client, images):
    with ImageServer({"cat.png": images[0]}) as server:
        for url in (f"{server.url}/cat.png", "http://localhost:9/x.png", "http://169.254.169.254/latest/"):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=chat_messages(url), max_tokens=2)
            assert err.value.status_code == 400
            assert err.value.body["code"] == "image_url_forbidden", err.value.body


def test_error_statuses_from_the_real_pair(pair, gateway, client, images):
    # 400: the gateway refuses what is no accepted image format (from the header), the decoder an image
    # whose header passes but whose pixels are cut off (INVALID_ARGUMENT), the gateway a bad field.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=chat_messages(data_url(b"not an image")),
                                       max_tokens=2)
    assert err.value.body["code"] == "invalid_image_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=chat_messages(data_url(images[0][:60])),
                                       max_tokens=2)
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=chat_messages(data_url(images[0])), n=200)
    assert err.value.body["param"] == "n"
    # 401: a wrong key, or none.
    with pytest.raises(openai.AuthenticationError):
        openai_client(gateway, "sk-wrong").models.list()
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert reply.status_code == 401 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    # 404: a model this server does not serve.
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=chat_messages(data_url(images[0])))
    assert err.value.body["code"] == "model_not_found"


def test_deadline_is_504(pair, tmp_path):
    g = GatewayProcess([pair.decoder.address], tmp_path / "gateway.log",
                       ["--served-model-name", "tiny", "--request-timeout", "0.001"]).start()
    try:
        with pytest.raises(openai.APIStatusError) as err:
            openai_client(g).completions.create(model="tiny", prompt="USER: count to a thousand. ASSISTANT:",
                                                max_tokens=500, extra_body={"ignore_eos": True})
        assert err.value.status_code == 504 and err.value.body["code"] == "deadline_exceeded"
    finally:
        g.stop()
    pair.wait_idle()


def test_dead_decoder_listed_first_is_skipped(open_gateway):
    client = openai_client(open_gateway)
    for _ in range(3):
        reply = client.completions.create(model="tiny", prompt="USER: hi ASSISTANT:", max_tokens=2)
        assert reply.usage.completion_tokens >= 1


def test_two_decoders_share_concurrent_requests(pair, tiny_model_dir, tmp_path):
    """A second decoder on the same encoder; concurrent requests go to both (least outstanding)."""
    argv = ["decoder", "--model", str(tiny_model_dir), "--encoder", pair.encoder.address,
            "--num-kv-blocks", "256"]
    second = Service("decoder2", argv, free_port(), tmp_path / "decoder2.log")
    second.start()
    g = GatewayProcess([pair.decoder.address, second.address], tmp_path / "gateway.log",
                       ["--served-model-name", "tiny"]).start()
    try:
        addresses = [pair.decoder.address, second.address]
        before = [DecoderClient(a, timeout=30).stats().requests_finished for a in addresses]
        client = openai_client(g)

        def one(i: int) -> int:
            return client.completions.create(model="tiny", prompt=f"USER: story number {i} ASSISTANT:",
                                             max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}).usage.completion_tokens

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [24] * 8
        after = [DecoderClient(a, timeout=30).stats().requests_finished for a in addresses]
        served = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(served) == 8 and min(served) >= 1, served
    finally:
        g.stop()
        second.stop()


def _aborted(pair) -> int:
    with pair.decoder_client() as dec:
        return dec.stats().requests_aborted


def test_client_leaving_mid_stream_frees_the_decoders_blocks(pair, client, images):
    before = _aborted(pair)
    stream = client.chat.completions.create(
        model="tiny", messages=chat_messages(data_url(images[0])), max_tokens=800, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 2:
            break
    with pair.decoder_client() as dec:
        assert dec.stats().kv_blocks_used > 0  # still generating: 800 tokens take seconds here
    stream.close()
    dec_stats, enc_stats = pair.wait_idle()
    assert dec_stats.kv_blocks_used == 0 and dec_stats.running == 0 and dec_stats.active_leases == 0
    assert enc_stats.active_leases == 0
    assert dec_stats.requests_aborted == before + 1  # cancelled, not run to its end


def test_client_leaving_a_whole_response_frees_the_decoders_blocks(pair, gateway):
    """A non-streamed completion whose client hangs up while it is generating: the decoder aborts it and
    frees its blocks. The client leaves once the decoder reports the request running (not after a fixed
    read timeout, which a fast machine outran: 900 tokens of the tiny model can take under a second)."""
    before = _aborted(pair)
    body = json.dumps({"model": "tiny", "prompt": "USER: count to a thousand. ASSISTANT:", "max_tokens": 900,
                       "ignore_eos": True, "temperature": 0}).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), KEY_A.encode(), len(body), body))
        deadline = time.monotonic() + 60
        with pair.decoder_client() as dec:
            while dec.stats().running == 0:
                assert time.monotonic() < deadline, "the completion never started"
                time.sleep(0.005)
    # the connection is closed: the gateway's client has gone while the decoder generates
    deadline = time.monotonic() + 60
    while _aborted(pair) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    dec_stats, _ = pair.wait_idle()
    assert dec_stats.kv_blocks_used == 0 and dec_stats.requests_aborted == before + 1


def test_metrics_count_requests_ttft_tokens_and_errors(gateway, client):
    client.completions.create(model="tiny", prompt="USER: hi ASSISTANT:", max_tokens=3, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    text = httpx.get(f"{gateway.url}/metrics").text
    assert 'mmserve_gateway_requests_total{endpoint="completions",status="200"}' in text
    assert 'mmserve_gateway_errors_total{code="model_not_found",status="404"}' in text
    assert 'mmserve_gateway_ttft_seconds_count{endpoint="completions"}' in text
    completion_tokens = [line for line in text.splitlines()
                         if line.startswith("mmserve_gateway_completion_tokens_total")]
    assert float(completion_tokens[0].split()[-1]) >= 3


def test_n_seeded_choices_equal_separate_requests_seeded_seed_plus_i(pair, client, images):
    # One decoder call for the 3 choices (GenerateRequest.n); choice i has the tokens of a request of its
    # own seeded 40 + i, whole and streamed.
    messages = chat_messages(data_url(images[2]))
    sampled = dict(model="tiny", messages=messages, max_tokens=6, temperature=1.0, logprobs=True,
                   extra_body={"ignore_eos": True})
    separate = [token_ids(client.chat.completions.create(seed=40 + i, **sampled).choices[0].logprobs.content)
                for i in range(3)]
    assert len({tuple(t) for t in separate}) > 1
    whole = client.chat.completions.create(seed=40, n=3, **sampled)
    assert [token_ids(c.logprobs.content) for c in sorted(whole.choices, key=lambda c: c.index)] == separate
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in client.chat.completions.create(seed=40, n=3, stream=True, **sampled):
        for c in chunk.choices:
            if c.logprobs:
                streamed[c.index] += token_ids(c.logprobs.content)
    assert [streamed[i] for i in range(3)] == separate
