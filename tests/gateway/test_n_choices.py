"""`n` on /v1/chat/completions: one decoder call for the n choices (GenerateRequest.n), whose messages'
`index` the gateway maps to choice indexes, whole and streamed. In-process over a fake decoder that
answers each of a call's n choices (tests/gateway/inprocess.py)."""

from __future__ import annotations

import json

from common.images import encode_png
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

PNG = encode_png(make_image(3, (24, 24)))


def _chat(n: int, stream: bool = False) -> dict:
    return {"model": "m", "n": n, "stream": stream, "max_tokens": 2, "seed": 9, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                     {"type": "text", "text": "hi"}]}]}


def test_n_choices_are_one_call_carrying_the_image_once():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat(3))
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["message"]["content"] == "ab" and c["finish_reason"] == "length"
                   for c in body["choices"])
        (sent,) = decoder.requests
        assert sent.n == 3 and sent.sampling.seed == 9
        assert sent.chat.messages[0].content[0].image.data == PNG
        # The prompt counted once (the fake's 3 tokens), every choice's 2 tokens.
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 6
        client.post("/v1/chat/completions", json=_chat(1))
        assert decoder.requests[1].n in (0, 1)  # n absent on the wire: one sample, as old decoders read it


def test_streamed_n_choices_get_their_role_tokens_and_finish_by_index():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json=_chat(4, stream=True))
        assert reply.status_code == 200, reply.text
        lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        events = [json.loads(line) for line in lines[:-1]]
        roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
        assert roles == [0, 1, 2, 3]
        texts = {i: "" for i in range(4)}
        for e in events:
            texts[e["choices"][0]["index"]] += e["choices"][0]["delta"].get("content") or ""
        assert texts == {i: "ab" for i in range(4)}
        finished = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
        assert finished == [0, 1, 2, 3]
        assert len(decoder.requests) == 1
