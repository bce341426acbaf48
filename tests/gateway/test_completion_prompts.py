"""/v1/completions as OpenAI and vLLM answer it: a list of prompts is served with one choice per prompt and
`n` (index = prompt x n + sample, usage counting each prompt once), and `logprobs: 0` gives each token's
top_logprobs entry with the sampled token alone (`logprobs: k`: it and the top k). In-process over a fake
decoder (tests/gateway/inprocess.py)."""

from __future__ import annotations

import json

from tests.gateway.inprocess import fake_decoder, gateway_client


def _events(reply) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_list_of_prompts_gets_one_choice_per_prompt_and_n_in_openais_order():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": ["one", "two", "three"], "n": 2,
                                                     "seed": 5})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert [c["index"] for c in body["choices"]] == list(range(6))
        assert all(c["text"] == "ab" and c["finish_reason"] == "length" for c in body["choices"])
        # One call per prompt (prompts never share a prefill), each for the n samples (the decoder seeds
        # sample i with seed + i), distinct ids under the response's.
        sent = sorted(decoder.requests, key=lambda r: r.request_id)
        assert [(r.prompt, r.n, r.sampling.seed) for r in sent] == [("one", 2, 5), ("two", 2, 5),
                                                                    ("three", 2, 5)]
        assert len({r.request_id for r in sent}) == 3
        assert all(r.request_id.startswith(body["id"] + "-") for r in sent)
        # The fake decoder counts 3 prompt tokens per call: three prompts, each once; 2 tokens per choice.
        assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        ids = client.post("/v1/completions", json={"model": "m", "prompt": [[1, 2], [3]]})
        assert ids.status_code == 200 and [c["index"] for c in ids.json()["choices"]] == [0, 1]
        assert sorted(list(r.prompt_token_ids.ids) for r in decoder.requests[3:]) == [[1, 2], [3]]


def test_a_streamed_list_of_prompts_numbers_its_choices_and_sums_usage():
    with fake_decoder() as (_, address), gateway_client(address) as client:
        reply = client.post("/v1/completions", json={
            "model": "m", "prompt": ["one", "two"], "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert reply.status_code == 200, reply.text
        events = _events(reply)
        finished = sorted(e["choices"][0]["index"] for e in events if e["choices"]
                          and e["choices"][0]["finish_reason"])
        assert finished == [0, 1, 2, 3]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 6
        assert events[-1]["usage"]["completion_tokens"] == 8
        assert events[-2]["usage"]["prompt_tokens"] == 6  # continuous usage: both prompts, each once


def test_prompts_times_n_is_bounded_and_each_prompt_is_checked():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": ["a"] * 65, "n": 2})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "too_many_choices"
        empty = client.post("/v1/completions", json={"model": "m", "prompt": ["a", ""]})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt.1"
        assert decoder.requests == []


def test_logprobs_zero_gives_the_sampled_token_alone_and_k_gives_it_with_the_top_k():
    with fake_decoder() as (_, address), gateway_client(address) as client:
        for stream in (False, True):
            reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 0,
                                                         "stream": stream})
            assert reply.status_code == 200, reply.text
            if stream:
                tops = [t for e in _events(reply) for t in e["choices"][0]["logprobs"]["top_logprobs"]]
            else:
                tops = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
            assert tops == [{"token_id:7": -0.5}, {"token_id:8": -0.5}], stream
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 2})
        logprobs = reply.json()["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"] == [-0.5, -0.5]
        # OpenAI: up to logprobs + 1 entries, the sampled token's among them even outside the top k.
        assert logprobs["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:100": -0.25,
                                               "token_id:101": -0.5}
