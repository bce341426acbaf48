"""Requests refused where vLLM refuses them (seed range, stream_options without stream, a bare-string
image_url, a non-JSON or missing body type, min_tokens above max_tokens, n over 128, a system image the chat
template drops, with the reason), extensions passed on (min_tokens, n), continuous usage, and one model by
its id."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from common.images import encode_png
from common.pb import decoder_pb2
from gateway.errors import APIError
from gateway.responses import RunningUsage, summed_usage
from gateway.schemas import ChatCompletionRequest, parse_body
from gateway.translate import chat_request, fan_out
from tests.gateway.conftest import KEY_A
from tests.gateway.harness import data_url
from tests.oracle import make_image

USER = [{"role": "user", "content": "x"}]
EOS_OFF = {"ignore_eos": True}


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "seed": 2**63}, "seed"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:,x"}]}]},
     "messages.0.content.0.image_url"),
    ({"messages": USER, "min_tokens": 4, "max_tokens": 3}, "min_tokens"),
    ({"messages": USER, "min_tokens": 4, "max_completion_tokens": 3, "max_tokens": 9}, "min_tokens"),
    ({"messages": USER, "n": 129}, "n"),
    ({"messages": USER, "n": 0}, "n"),
])
def test_vllm_strict_fields_are_400_naming_the_parameter(body, param):
    with pytest.raises(APIError) as err:
        asyncio.run(chat_request(parse_body(ChatCompletionRequest, {"model": "m", **body}), None, ""))
    assert err.value.status == 400 and err.value.param == param


def test_largest_seed_and_zero_min_tokens_pass():
    req = parse_body(ChatCompletionRequest,
                     {"model": "m", "messages": USER, "seed": 2**63 - 1, "min_tokens": 0})
    assert asyncio.run(chat_request(req, None, "")).sampling.seed == 2**63 - 1


def test_min_tokens_reaches_the_decoder_and_n_fans_out_with_vllms_seeds():
    req = parse_body(ChatCompletionRequest, {"model": "m", "messages": USER, "min_tokens": 5,
                                             "max_tokens": 5, "seed": 2**63 - 1})
    out = asyncio.run(chat_request(req, None, ""))
    assert out.sampling.min_tokens == 5
    children = fan_out(out, 3)
    assert [c.request_id for c in children] == [f"{out.request_id}-{i}" for i in range(3)]
    assert [c.sampling.seed for c in children] == [2**63 - 1, 2**63, 2**63 + 1]  # seed + i, as vLLM
    assert all(c.chat == out.chat and c.sampling.min_tokens == 5 for c in children)
    unseeded = fan_out(asyncio.run(chat_request(parse_body(ChatCompletionRequest, {
        "model": "m", "messages": USER}), None, "")), 2)
    assert not any(c.sampling.HasField("seed") for c in unseeded)
    assert fan_out(out, 1) == [out]


def test_usage_of_several_choices_counts_the_prompt_once():
    usages = [decoder_pb2.Usage(prompt_tokens=9, completion_tokens=4, cached_prompt_tokens=0),
              decoder_pb2.Usage(prompt_tokens=9, completion_tokens=6, cached_prompt_tokens=8)]
    assert summed_usage(usages) == {"prompt_tokens": 9, "completion_tokens": 10, "total_tokens": 19,
                                    "prompt_tokens_details": {"cached_tokens": 0}}


def test_running_usage_counts_tokens_and_takes_the_decoders_prompt_count():
    running = RunningUsage()
    assert running.add(decoder_pb2.GenerateResponse(token_ids=[1, 2]))["completion_tokens"] == 2
    last = decoder_pb2.GenerateResponse(token_ids=[3], usage=decoder_pb2.Usage(
        prompt_tokens=7, completion_tokens=3, cached_prompt_tokens=4))
    assert running.add(last) == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                 "prompt_tokens_details": {"cached_tokens": 4}}


def test_a_form_body_is_415(gateway):
    request = urllib.request.Request(
        f"{gateway.url}/v1/chat/completions", data=json.dumps({"model": "tiny", "messages": USER}).encode(),
        headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/x-www-form-urlencoded"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 415
    assert json.loads(err.value.read())["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_puts_usage_on_every_chunk(client, endpoint):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if endpoint == "chat":
        stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                                stream=True, stream_options=options, extra_body=EOS_OFF)
    else:
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0,
                                           stream=True, stream_options=options, extra_body=EOS_OFF)
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8  # cumulative, ending at the total
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0
    # The prompt's count from the first chunk on, as vLLM sends it (the decoder's first message has it).
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_models_lists_root_and_max_model_len(open_gateway, tiny_model_dir):
    with urllib.request.urlopen(f"{open_gateway.url}/v1/models", timeout=10) as reply:
        card = json.loads(reply.read())["data"][0]
    assert card["id"] == "tiny" and card["root"] == str(tiny_model_dir) and card["max_model_len"] == 1024


def test_a_body_without_content_type_is_415(gateway):
    request = urllib.request.Request(  # urllib sends a body's type unless one is set: set it empty
        f"{gateway.url}/v1/chat/completions", data=json.dumps({"model": "tiny", "messages": USER}).encode(),
        headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": ""})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 415


def test_models_retrieve_and_its_404(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope")
    assert err.value.body["code"] == "model_not_found"


def test_a_system_image_the_tiny_template_drops_is_refused_with_the_reason(client):
    # The tiny LLaVA's template renders a system message's text only (as LLaVA-1.5's does).
    image = {"type": "image_url", "image_url": {"url": data_url(encode_png(make_image(1, (16, 16))))}}
    messages = [{"role": "system", "content": [image, {"type": "text", "text": "a reference"}]}, *USER]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert "drops the images and videos of system messages" in err.value.body["message"]
    assert err.value.body["param"] == "messages.0.content.0"
