"""What vLLM accepts and a newcomer expects, through the gateway (in-process, over a fake decoder that
records what reaches it): the served name as typed and its folder's name, no `model` at all, images in
system messages, custom roles, signed 64-bit seeds, /v1/models' permission, the last text in the finish
chunk, prompt_tokens on every continuous-usage chunk, and the Qwen-VL processor options in HF's forms
(or refused, never ignored)."""

from __future__ import annotations

import json

import pytest

from common.images import encode_png
from tests.gateway.harness import data_url
from tests.gateway.inprocess import fake_decoder, gateway_client
from tests.oracle import make_image

PNG = encode_png(make_image(4, (16, 16)))
IMAGE = {"type": "image_url", "image_url": {"url": data_url(PNG)}}


def _events(reply) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_served_name_is_the_path_as_typed_and_its_folder_name(tiny_model_dir):
    typed = str(tiny_model_dir)
    with fake_decoder() as (_, address), gateway_client(address, model=typed,
                                                        served_model_names=[]) as client:
        for name in (typed, tiny_model_dir.name):
            reply = client.post("/v1/completions", json={"model": name, "prompt": "hi"})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == typed  # responses carry the first name, as vLLM's
        cards = client.get("/v1/models").json()["data"]
        assert [card["id"] for card in cards] == [typed, tiny_model_dir.name]
        assert client.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404


def test_a_request_without_model_gets_the_served_model():
    with fake_decoder() as (_, address), gateway_client(address) as client:
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "m"
        assert client.post("/v1/completions", json={"prompt": "hi"}).json()["model"] == "m"


def test_images_in_system_messages_and_custom_roles_reach_the_decoder():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        body = {"model": "m", "messages": [
            {"role": "system", "content": [IMAGE, {"type": "text", "text": "a reference image"}]},
            {"role": "critic", "content": "be harsh"}, {"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        (sent,) = decoder.requests
        assert [m.role for m in sent.chat.messages] == ["system", "critic", "user"]
        assert sent.chat.messages[0].content[0].image.data == PNG
        for role in ("two words", "user\nASSISTANT", "{{ 7*7 }}", "", "x" * 65):
            bad = {"model": "m", "messages": [{"role": role, "content": "hi"}]}
            reply = client.post("/v1/chat/completions", json=bad)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.0.role", role
        assistant = {"model": "m", "messages": [{"role": "assistant", "content": [IMAGE]}]}
        assert client.post("/v1/chat/completions", json=assistant).status_code == 400


@pytest.mark.parametrize("seed, sent", [(-1, 2**64 - 1), (-(2**63), 2**63), (2**63 - 1, 2**63 - 1), (0, 0)])
def test_signed_64_bit_seeds(seed, sent):
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "seed": seed, "n": 2})
        assert reply.status_code == 200, reply.text
        # One call for both samples; the decoder seeds sample i with seed + i (engine/fanout.py).
        assert [(r.sampling.seed, r.n) for r in decoder.requests] == [(sent, 2)]
        low = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "seed": -(2**63) - 1})
        assert low.status_code == 400 and low.json()["error"]["param"] == "seed"


def test_models_lists_vllms_permission_entry():
    with fake_decoder() as (_, address), gateway_client(address) as client:
        (card,) = client.get("/v1/models").json()["data"]
        (permission,) = card["permission"]
        assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
        assert permission["allow_sampling"] and permission["allow_logprobs"]
        assert permission["organization"] == "*"


def test_the_finish_chunk_carries_the_last_text_and_every_usage_chunk_the_prompt():
    options = {"include_usage": True, "continuous_usage_stats": True}
    with fake_decoder() as (_, address), gateway_client(address) as client:
        chat = _events(client.post("/v1/chat/completions", json={
            "model": "m", "stream": True, "stream_options": options,
            "messages": [{"role": "user", "content": "hi"}]}))
        role, first, finish, summary = chat
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert first["choices"][0]["delta"] == {"content": "a"}
        assert finish["choices"][0] == {"index": 0, "delta": {"content": "b"}, "logprobs": None,
                                        "finish_reason": "length"}  # the last text and the reason, together
        assert [c["usage"]["prompt_tokens"] for c in chat] == [3, 3, 3, 3]  # from the role chunk on
        assert [c["usage"]["completion_tokens"] for c in chat] == [0, 1, 2, 2]
        text = _events(client.post("/v1/completions", json={
            "model": "m", "prompt": "hi", "stream": True, "stream_options": options}))
        assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in text[:-1]] == [
            ("a", None), ("b", "length")]
        assert all(c["usage"]["prompt_tokens"] == 3 for c in text)


def _qwen_chat(kwargs: dict, **extra) -> dict:
    return {"model": "m", "mm_processor_kwargs": kwargs, **extra,
            "messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "hi"}]}]}


def test_processor_options_in_hfs_forms_or_refused(qwen_model_dir):
    with fake_decoder() as (decoder, address), gateway_client(address, model=str(qwen_model_dir)) as client:
        size = {"size": {"shortest_edge": 1000, "longest_edge": 200_000}, "do_sample_frames": True}
        assert client.post("/v1/chat/completions", json=_qwen_chat(size)).status_code == 200
        image = decoder.requests[-1].chat.messages[0].content[0].image
        assert (image.min_pixels, image.max_pixels) == (1000, 200_000)
        refused = [
            (_qwen_chat({"do_sample_frames": False}), "mm_processor_kwargs.do_sample_frames"),
            (_qwen_chat({"min_pixels": 5, "size": {"shortest_edge": 6}}), "mm_processor_kwargs.min_pixels"),
            (_qwen_chat({}, media_io_kwargs={"video": {"num_frames": 8}}), "media_io_kwargs"),
        ]
        for body, param in refused:
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        assert len(decoder.requests) == 1


def test_token_id_prompts_reach_the_decoder_as_ids():
    with fake_decoder() as (decoder, address), gateway_client(address) as client:
        for prompt in ([5, 6, 7], [[5, 6, 7]]):
            reply = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
            assert reply.status_code == 200, reply.text
        assert [list(r.prompt_token_ids.ids) for r in decoder.requests] == [[5, 6, 7], [5, 6, 7]]
        assert all(r.WhichOneof("input") == "prompt_token_ids" for r in decoder.requests)
        for prompt in ([], [[]], [2**31]):  # several prompts are served (test_completion_prompts.py)
            reply = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
            assert reply.status_code == 400, (prompt, reply.text)
