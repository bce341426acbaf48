"""vLLM's extensions through the official OpenAI client, against a real gateway and pair on the tiny
model: `n` > 1 (several choices sharing the prompt's KV), `min_tokens`, and one token per SSE event."""

from __future__ import annotations

import uuid
from collections import defaultdict

from tests.gateway.conftest import openai_client

PROMPT = ("Describe a quiet harbour town at dawn: the boats, the gulls, the fish market, the bakery and "
          "the old lighthouse on the hill above the bay.")
USER = [{"role": "user", "content": PROMPT}]
EOS_OFF = {"ignore_eos": True}


def _forked(pair) -> int:
    with pair.decoder_client() as dec:
        return dec.stats().samples_forked


def test_n_chat_choices_whole_and_streamed_share_the_prompt(pair, gateway):
    client = openai_client(gateway)
    salt = {"cache_salt": uuid.uuid4().hex}  # a fresh cache: only the choices' own sharing can hit it
    one = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                         extra_body={**EOS_OFF, "cache_salt": uuid.uuid4().hex})
    forked = _forked(pair)
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=1.0,
                                           seed=7, n=3, extra_body={**EOS_OFF, **salt})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in whole.choices)
    assert len({c.message.content for c in whole.choices}) > 1  # seeds seed+i: the choices differ
    # vLLM's usage: the prompt once, every choice's tokens.
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens and whole.usage.completion_tokens == 24
    # One decoder request: the prompt prefilled once, choices 1 and 2 forked from its KV (engine/fanout.py).
    assert _forked(pair) - forked == 2

    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=1.0,
                                            seed=7, n=3, stream=True, stream_options={"include_usage": True},
                                            extra_body={**EOS_OFF, **salt})
    texts, finishes, roles = defaultdict(str), {}, set()
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        roles.update([choice.index] if choice.delta.role == "assistant" else [])
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]  # same seeds
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens


def test_n_completion_choices_whole_and_streamed(gateway):
    client = openai_client(gateway)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, n=2,
                                      logprobs=1, extra_body=EOS_OFF)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].text == whole.choices[1].text  # greedy: the same text twice
    assert [len(c.logprobs.tokens) for c in whole.choices] == [5, 5]
    assert whole.usage.completion_tokens == 10
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, n=2,
                                       stream=True, extra_body=EOS_OFF)
    texts, finishes = defaultdict(str), {}
    for chunk in stream:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length"} and texts[0] == texts[1] == whole.choices[0].text


def test_min_tokens_holds_a_stop_string_back(gateway):
    client = openai_client(gateway)
    free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body=EOS_OFF)
    stop = next(c for c in free.choices[0].text if not c.isspace())  # in the first token's text or soon
    early = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                      extra_body=EOS_OFF)
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < 10
    held = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={**EOS_OFF, "min_tokens": 10})
    assert held.usage.completion_tokens >= 10
    assert held.choices[0].text.startswith(early.choices[0].text + stop)


def test_one_token_per_sse_event(gateway):
    # The gateway without a tokenizer names each token in logprobs: one entry per event means one token.
    client = openai_client(gateway)
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0,
                                            logprobs=True, stream=True, extra_body=EOS_OFF)
    per_event = [len(c.choices[0].logprobs.content) for c in stream
                 if c.choices and c.choices[0].logprobs is not None]
    assert per_event == [1] * 16
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                       stream=True, extra_body=EOS_OFF)
    per_event = [len(c.choices[0].logprobs.tokens) for c in stream if c.choices[0].logprobs is not None]
    assert per_event == [1] * 16


def test_a_list_of_prompts_and_logprobs_zero(pair, gateway):
    client = openai_client(gateway)
    prompts = [PROMPT, "Hello there", PROMPT]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0, n=2,
                                      logprobs=0, extra_body=EOS_OFF)
    assert [c.index for c in whole.choices] == list(range(6))  # prompt x n + sample, as OpenAI numbers them
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                       extra_body=EOS_OFF) for p in prompts]
    assert [c.text for c in whole.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # each prompt once
    assert whole.usage.completion_tokens == 18
    for choice in whole.choices:  # logprobs 0: each position's entry is the sampled token alone
        assert [list(top.values()) for top in choice.logprobs.top_logprobs] == [
            [lp] for lp in choice.logprobs.token_logprobs]
