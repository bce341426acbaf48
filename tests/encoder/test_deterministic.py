"""The encoder's --deterministic mode: an image's embedding does not depend on the other images of its
request or batch, and the vision attention's kernel is chosen by shape, never by a timing."""

from __future__ import annotations

import pytest
import torch

from common.images import encode_png
from common.pb import common_pb2
from common.transport import import_embedding
from common.vision import attention
from encoder_svc.config import EncoderConfig
from tests.encoder.conftest import EncoderHarness, encode_request

INLINE = (common_pb2.TRANSPORT_INLINE,)


def test_fixed_choices_pick_the_attention_kernel_by_shape(monkeypatch):
    """With fixed choices the dense-vs-varlen decision never times the candidates: long uniform spans take
    the dense call where it runs, short ones varlen; an unavailable dense call falls back."""
    calls = []
    monkeypatch.setattr(attention, "_time_ms", lambda run: calls.append(run) or 1.0)
    monkeypatch.setattr(attention, "_dense", lambda q, k, v, spans, scale: q)
    q = torch.zeros(2 * 2048, 2, 16)
    try:
        attention.use_fixed_choices()
        long_spans = attention.AttentionSpans(torch.tensor([0, 2048, 4096]), 2048, True, uniform=True)
        short_spans = attention.AttentionSpans(torch.tensor([0, 256, 512]), 256, True, uniform=True)
        assert attention._dense_is_faster(q, q, q, long_spans, 1.0)
        assert not attention._dense_is_faster(q[:512], q[:512], q[:512], short_spans, 1.0)

        def broken(*args):
            raise RuntimeError("no cuDNN attention here")

        monkeypatch.setattr(attention, "_dense", broken)
        wide = attention.AttentionSpans(torch.tensor([0, 3000]), 3000, True, uniform=True)
        assert not attention._dense_is_faster(q[:3000], q[:3000], q[:3000], wide, 1.0)
        assert calls == [], "nothing timed"
    finally:
        attention.use_fixed_choices(False)
    assert attention._DENSE_FASTER == {}, "switching back forgets the fixed decisions"


@pytest.mark.parametrize("deterministic", [True, False])
def test_an_image_alone_and_in_company_gives_the_same_embedding(qwen3_model_dir, qwen_images, deterministic):
    """Through Encode: image A alone, then A with two others in one request (one tower batch), on fresh
    cache salts; in the mode the rows are the same bits (on a CPU they are without it too)."""
    harness = EncoderHarness(EncoderConfig(model=qwen3_model_dir, cache_bytes=64 << 20, decode_processes=0,
                                           deterministic=deterministic))
    try:
        assert harness.servicer.worker.batch_invariant is deterministic
        files = [encode_png(image) for image in qwen_images]
        alone = harness.stub.Encode(encode_request(files[0], accept=INLINE, cache_salt="a"), timeout=60)
        together = harness.stub.Encode(encode_request(*files, accept=INLINE, cache_salt="b"), timeout=60)
        first = import_embedding(alone.embeddings[0]).clone()
        again = import_embedding(together.embeddings[0]).clone()
        assert torch.equal(first, again)
        harness.release_all(alone)
        harness.release_all(together)
    finally:
        harness.close()
        attention.use_fixed_choices(False)
