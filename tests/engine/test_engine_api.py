"""LLMEngine's request validation and error paths."""

from __future__ import annotations

import pytest

from common.images import encode_png
from decoder_svc.engine import FinishReason, InvalidRequestError, SamplingParams
from decoder_svc.tokenization import PlaceholderMismatchError

ONE = "USER: <image>\nWhat is this? ASSISTANT:"


def test_bad_requests_are_refused(make_engine, images):
    engine = make_engine(num_kv_blocks=8)
    with pytest.raises(PlaceholderMismatchError):
        engine.add_request("a", ONE, [])
    with pytest.raises(PlaceholderMismatchError):
        engine.add_request("b", "no marker", images[:1])
    with pytest.raises(InvalidRequestError, match="empty input"):
        engine.add_request("c", "")
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.add_request("d", "hi", sampling=SamplingParams(max_tokens=5000))
    with pytest.raises(InvalidRequestError, match="KV cache"):
        engine.add_request("e", "hi", sampling=SamplingParams(max_tokens=200))
    with pytest.raises(InvalidRequestError, match="image 0"):
        engine.add_request("f", ONE, [b"not an image"])
    with pytest.raises(InvalidRequestError):
        engine.add_request("g", "hi", sampling=SamplingParams(temperature=-1))
    engine.add_request("h", "hi", sampling=SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("h", "hi", sampling=SamplingParams(max_tokens=2))
    assert engine.stats().waiting == 1


def test_png_bytes_and_pil_give_same_tokens(make_engine, images):
    engine = make_engine(enable_prefix_caching=False)
    a = engine.generate("pil", ONE, images[:1], sampling=SamplingParams(max_tokens=8))
    b = engine.generate("png", ONE, [encode_png(images[0])], sampling=SamplingParams(max_tokens=8))
    assert a.new_token_ids == b.new_token_ids
    assert b.usage.images_encoder_cache_hits == 1  # same pixels: same content hash


def test_content_hash_reference(make_engine, images):
    engine = make_engine(enable_prefix_caching=False)
    first = engine.add_request("first", ONE, images[:1], sampling=SamplingParams(max_tokens=8))
    h = first.images[0].content_hash
    while engine.has_unfinished():
        engine.step()
    known = engine.generate("known", ONE, [h], sampling=SamplingParams(max_tokens=8))
    assert known.finish_reason == FinishReason.LENGTH and known.usage.images_encoder_cache_hits == 1
    unknown = engine.generate("unknown", ONE, ["ab" * 32], sampling=SamplingParams(max_tokens=8))
    assert unknown.finish_reason == FinishReason.ERROR and "not found" in unknown.error
    assert engine.stats().kv_blocks_used == 0
