"""The in-process embedding source scopes hash-only reuse by cache_salt, as the encoder service does."""

from __future__ import annotations

import torch

from common.checkpoint import model_fingerprint
from common.hashing import hash_image
from decoder_svc.engine import EmbeddingRequest, EmbeddingState
from decoder_svc.engine.local_source import LocalEmbeddingSource


def test_hash_only_ask_resolves_only_under_the_salt_it_was_made_with(tiny_model_dir, images):
    source = LocalEmbeddingSource(tiny_model_dir)
    key = hash_image(images[0], model_fingerprint(tiny_model_dir), "tenant-a")
    source.request(EmbeddingRequest("a1", key, images[0], cache_salt="tenant-a"))
    assert source.poll("a1", key) == EmbeddingState.READY
    for rid, salt in (("b1", "tenant-b"), ("b2", "")):
        source.request(EmbeddingRequest(rid, key, None, cache_salt=salt))
        assert source.poll(rid, key) == EmbeddingState.FAILED and "not found" in source.error(rid, key)
    source.request(EmbeddingRequest("a2", key, None, cache_salt="tenant-a"))
    assert source.poll("a2", key) == EmbeddingState.READY and source.cache_hit("a2", key)
    assert torch.equal(source.get("a2", key), source.get("a1", key))
    assert source.num_encoded == 1
