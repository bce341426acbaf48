"""Prompts given as token ids (vLLM's `/v1/completions` with a list of ids): used as they are, the same
output as the text they tokenize from; ids outside the vocabulary, image placeholder ids, an empty list
or ids with images are refused (INVALID_ARGUMENT)."""

from __future__ import annotations

import pytest

from common.errors import ServiceError
from common.pb import common_pb2, decoder_pb2
from decoder_svc.engine import InvalidRequestError, SamplingParams
from decoder_svc.wire import parse_request

TEXT = "USER: tell me about the sea ASSISTANT:"


def test_token_ids_give_the_texts_output(make_engine):
    engine = make_engine()
    ids = engine.inputs.tokenizer.tokenizer(TEXT)["input_ids"]
    def sampling() -> SamplingParams:
        return SamplingParams(max_tokens=6, ignore_eos=True)

    text = engine.generate("text", TEXT, sampling=sampling())
    by_ids = engine.generate("ids", prompt_token_ids=ids, sampling=sampling())
    assert by_ids.new_token_ids == text.new_token_ids and by_ids.usage.prompt_tokens == len(ids)


def test_bad_token_id_prompts_are_refused(make_engine, images):
    engine = make_engine()
    vocab = engine.inputs.model_config.vocab_size
    image_id = engine.inputs.tokenizer.image_token_id
    for ids, match in (([], "no ids"), ([1, vocab], "outside the vocabulary"), ([-1], "outside"),
                       ([1, image_id], "image or video placeholder"), ([1] * 5000, "context length")):
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request("r", prompt_token_ids=ids)
    with pytest.raises(InvalidRequestError, match="no images"):
        engine.add_request("r", None, images[:1], prompt_token_ids=[1, 2])
    request = decoder_pb2.GenerateRequest(prompt_token_ids=decoder_pb2.TokenIds(ids=[1, 2]))
    assert parse_request(request).prompt_token_ids == [1, 2]
    request.images.append(common_pb2.ImageInput(data=b"x"))
    with pytest.raises(ServiceError, match="takes no images"):
        parse_request(request)
