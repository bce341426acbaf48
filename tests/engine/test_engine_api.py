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
    # A file is named by its bytes, a PIL image by its pixels: two entries; the same file again is one.
    assert b.usage.images_encoder_cache_hits == 0
    c = engine.generate("png2", ONE, [encode_png(images[0])], sampling=SamplingParams(max_tokens=8))
    assert c.new_token_ids == a.new_token_ids and c.usage.images_encoder_cache_hits == 1


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


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=1e-45), dict(temperature=-0.5),
                                 dict(temperature=1.0, top_p=float("nan"))])
def test_sampling_values_no_sampler_can_honour_are_refused(make_engine, bad):
    engine = make_engine(num_kv_blocks=8)
    with pytest.raises(InvalidRequestError, match="temperature|top_p"):
        engine.add_request("x", "hi", sampling=SamplingParams(max_tokens=2, **bad))
    ok = engine.generate("ok", "hi", sampling=SamplingParams(max_tokens=2, temperature=1e-5))
    assert ok.finish_reason == FinishReason.LENGTH


def test_a_failing_model_call_fails_its_requests_not_the_engine(make_engine, monkeypatch):
    engine = make_engine(num_kv_blocks=32)
    engine.add_request("a", "hi there", sampling=SamplingParams(max_tokens=4))
    engine.add_request("b", "hello", sampling=SamplingParams(max_tokens=4))
    for name in ("execute", "launch"):  # the synchronous and the asynchronous engine's call
        monkeypatch.setattr(engine.runner, name, lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finish_reason == FinishReason.ERROR and o.error == "internal error: RuntimeError"
               for o in outs)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.requests_failed == 2 and not engine.has_unfinished()
    monkeypatch.undo()
    out = engine.generate("c", "hi there", sampling=SamplingParams(max_tokens=4))
    assert out.finish_reason == FinishReason.LENGTH and len(out.new_token_ids) == 4


def test_a_failure_in_one_requests_output_fails_only_that_request(make_engine, monkeypatch):
    engine = make_engine(num_kv_blocks=32)
    bad = engine.add_request("bad", "hi there", sampling=SamplingParams(max_tokens=4))
    engine.add_request("good", "hello", sampling=SamplingParams(max_tokens=4))
    monkeypatch.setattr(engine.outputs._detokenizers[bad.request_id], "add", lambda ids: 1 / 0)
    results: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            results.setdefault(o.request_id, []).append(o)
    assert results["bad"][-1].finish_reason == FinishReason.ERROR
    assert results["good"][-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in results["good"]) == 4
    assert engine.stats().kv_blocks_used == 0


def _refuse_work(monkeypatch, engine):
    """Make any hashing or tokenizing fail loudly: a refused request must not reach them."""
    import decoder_svc.engine.input_processor as input_module

    def boom(*a, **kw):
        raise AssertionError("work done on a request that the limits refuse")

    monkeypatch.setattr(input_module, "hash_image_file", boom)
    monkeypatch.setattr(engine.tokenizer, "encode_prompt", boom)
    monkeypatch.setattr(engine.tokenizer, "encode_chat", boom)


def test_limits_are_checked_before_any_decoding_or_tokenizing(make_engine, monkeypatch, images):
    from PIL import Image

    engine = make_engine(num_kv_blocks=8)
    big = encode_png(Image.new("RGB", (8192, 8192)))  # ~200 KB of PNG, 201 MB of pixels
    small = encode_png(images[0])
    _refuse_work(monkeypatch, engine)
    cases = [
        (dict(prompt="USER: <image> hi", images=[big]), "pixels"),
        (dict(prompt="USER: " + "<image>" * 17, images=[small] * 17), "at most 16"),
        (dict(prompt="x" * (2 << 20)), "bytes exceeds"),
        (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * (2 << 20)}]}]),
         "bytes exceeds"),
        (dict(prompt="hi", cache_salt="s" * 300), "cache_salt"),
        (dict(prompt="hi", sampling=SamplingParams(stop=["x" * 300])), "stop strings"),
        (dict(prompt="hi", sampling=SamplingParams(stop=["a"] * 17)), "stop strings"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(InvalidRequestError, match=needle):
            engine.inputs.make_request("x", **kwargs)


def test_client_facing_image_errors_carry_no_heap_addresses(make_engine):
    engine = make_engine(num_kv_blocks=8)
    with pytest.raises(InvalidRequestError) as err:
        engine.inputs.make_request("x", "USER: <image> hi", [b"\x89PNG not really"])
    assert " at 0x" not in str(err.value) and "image 0" in str(err.value)


def test_image_files_are_named_by_their_bytes_without_decoding(make_engine, monkeypatch, images):
    """A request keeps the encoded bytes only and names each file by them: nothing is decoded on the
    decoder (the encoder decodes an image it lacks), and the name is the encoder's (hash_image_file)."""
    import common.images as images_module
    from common.hashing import hash_image_file
    from common.image_geometry import hash_fingerprint

    engine = make_engine(num_kv_blocks=64)
    files = [encode_png(img) for img in images]

    def no_decode(*args, **kwargs):
        raise AssertionError("the decoder decoded an image file")

    monkeypatch.setattr(images_module, "decode_image", no_decode)
    req = engine.inputs.make_request("x", "USER: " + "<image>" * len(files) + " hi", files,
                                     cache_salt="tenant")
    fingerprint = hash_fingerprint(engine.inputs.fingerprint, None)
    for placeholder, data in zip(req.images, files, strict=True):
        assert placeholder.image is data  # the file as sent, never its pixels
        assert placeholder.content_hash == hash_image_file(data, fingerprint, "tenant")
