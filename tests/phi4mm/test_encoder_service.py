"""Phi-4-MM images through the encoder service (a real grpc.aio server on 127.0.0.1, CPU, SHM arena): each
image's embedding equals HF's Phi4MultimodalImageEmbedding (fp32) with the layout's row count, over SHM
and inline bytes; a repeat is a cache hit; the hash follows the bytes and the HD settings and is the one
the decoder's input processor makes; bad input gets INVALID_ARGUMENT naming the image and the service
goes on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from common.checkpoint import load_config
from common.families import family_of
from common.families.phi4mm import FAMILY
from common.images import ImageLimits, encode_png
from common.pb import common_pb2, encoder_pb2
from common.transport import import_embedding
from decoder_svc.engine.config import EngineConfig
from decoder_svc.engine.input_processor import InputProcessor
from encoder_svc.server import EncoderConfig
from tests.encoder.conftest import EncoderHarness, encode_request
from tests.phi4mm.images import noise_image, sample_images

SHM, INLINE = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE
REL_TOL = 1e-4  # as test_embedding.py: fp32, SDPA against HF's eager attention (~1e-6 seen)
# one crop; portrait; landscape past 2 crops; tall and thin; past dynamic_hd (the aspect search): indices
# of tests/phi4mm/images.SIZES
ASPECTS = [0, 1, 2, 3, 6]


@pytest.fixture(scope="module")
def phi4_encoder(phi4_tiny_dir: Path) -> Iterator[EncoderHarness]:
    """One CPU encoder service on phi-4-mm-tiny: 16 MiB cache, 4 images per request."""
    limits = ImageLimits(max_side=12000, max_images_per_request=4)
    harness = EncoderHarness(EncoderConfig(model=phi4_tiny_dir, cache_bytes=16 << 20, lease_ttl_s=30,
                                           limits=limits))
    yield harness
    harness.close()


@pytest.fixture
def encoder(phi4_encoder: EncoderHarness) -> Iterator[EncoderHarness]:
    """The module's encoder; no lease may be left active after a test."""
    yield phi4_encoder
    assert phi4_encoder.stats().active_leases == 0, "a test (or the server) leaked a lease"


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    assert scale > 1.0, "the tiny checkpoint's features should not be degenerate"
    assert (ours - ref).abs().max().item() <= REL_TOL * scale


def test_the_family_serves_the_checkpoint(phi4_tiny_dir):
    assert family_of(load_config(phi4_tiny_dir)) is FAMILY


@pytest.mark.parametrize("index", ASPECTS)
def test_one_image_equals_hf_with_the_layouts_rows(encoder, phi4_oracle, index):
    image = sample_images()[index]
    resp = encoder.stub.Encode(encode_request(encode_png(image), accept=[SHM]), timeout=60)
    ref = resp.embeddings[0]
    layout = encoder.servicer.vision.layout
    assert ref.WhichOneof("location") == "shm" and not ref.cache_hit
    assert list(ref.shape) == [layout.tokens_for_size(*image.size), 64]
    assert list(ref.grid_thw) == list(layout.grid(image.height, image.width))
    (expected,) = phi4_oracle.image_features([image])
    _close(import_embedding(ref), expected)
    encoder.release_all(resp)


def test_a_batch_of_sizes_is_one_tower_call_equal_to_hf_batched(encoder, phi4_oracle):
    images = [sample_images()[i] for i in (4, 2, 5)]  # 4, 3 and 16 crops: HF pads the batch's crops
    calls = encoder.servicer.vision.calls
    resp = encoder.stub.Encode(encode_request(*[encode_png(im) for im in images], accept=[INLINE]),
                               timeout=60)
    assert encoder.servicer.vision.calls == calls + 1
    for ref, expected in zip(resp.embeddings, phi4_oracle.image_features(images), strict=True):
        assert ref.WhichOneof("location") == "inline_data"
        _close(import_embedding(ref), expected)


def test_a_repeat_is_a_hit_by_bytes_and_by_hash_with_its_grid(encoder):
    image = noise_image(700, 300, 7)
    data = encode_png(image)
    first = encoder.stub.Encode(encode_request(data), timeout=60)
    calls = encoder.servicer.vision.calls
    again = encoder.stub.Encode(encode_request(data, accept=[INLINE]), timeout=60)
    key = first.embeddings[0].content_hash
    by_hash = encoder.stub.Encode(encoder_pb2.EncodeRequest(
        images=[common_pb2.ImageInput(content_hash=key)], accept=[SHM]), timeout=60)
    assert encoder.servicer.vision.calls == calls, "cache hits must not run the tower"
    assert again.embeddings[0].cache_hit and by_hash.embeddings[0].cache_hit
    assert torch.equal(import_embedding(again.embeddings[0]), import_embedding(first.embeddings[0]))
    # a hash-only image's token count comes from the grid the entry keeps (the decoder's known_grids)
    lookup = encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[key]), timeout=10)
    grid = tuple(lookup.grids[0].thw)
    assert grid == encoder.servicer.vision.layout.grid(300, 700)
    assert encoder.servicer.vision.layout.num_tokens(grid) == first.embeddings[0].shape[0]
    encoder.release_all(first)
    encoder.release_all(by_hash)


def test_the_hash_is_the_decoders_and_follows_size_and_dynamic_hd(encoder, phi4_tiny_dir, tmp_path):
    small, large = noise_image(500, 300, 9), noise_image(1000, 600, 9)
    resp = encoder.stub.Encode(encode_request(encode_png(small), encode_png(large)), timeout=60)
    hashes = [r.content_hash for r in resp.embeddings]
    assert hashes[0] != hashes[1]
    # The decoder's input processor names the image by the same hash and gives it as many tokens as the
    # encoder gives rows.
    config = EngineConfig(model=phi4_tiny_dir, num_kv_blocks=8)
    inputs = InputProcessor.for_model(config, kv_capacity_tokens=1 << 16)
    req = inputs.make_request("r", "<|user|><|image|> and <|image|><|end|><|assistant|>",
                              [encode_png(small), encode_png(large)])
    assert [p.content_hash for p in req.images] == hashes
    assert [p.length for p in req.images] == [r.shape[0] for r in resp.embeddings]
    encoder.release_all(resp)
    # Another dynamic_hd (the image processor config: outside config.json and the weights) is another
    # embedding: another fingerprint, so another hash, on both sides.
    other = tmp_path / "hd4"
    shutil.copytree(phi4_tiny_dir, other)
    processor = json.loads((other / "processor_config.json").read_text())
    processor["image_processor"]["dynamic_hd"] = 4
    (other / "processor_config.json").write_text(json.dumps(processor))
    fewer = InputProcessor.for_model(EngineConfig(model=other, num_kv_blocks=8),
                                     kv_capacity_tokens=1 << 16)
    req4 = fewer.make_request("r", "<|image|>", [encode_png(large)])
    assert req4.images[0].content_hash != hashes[1]
    assert req4.images[0].length < req.images[1].length  # 4 crops at most instead of 6
    assert FAMILY.make_vision_encoder(other).fingerprint != encoder.servicer.vision.fingerprint


def _bomb() -> bytes:
    from PIL import Image

    return encode_png(Image.new("1", (9000, 9000)))  # 81 Mpx, above Pillow's limit; a few KiB


BAD = {
    "corrupt": (lambda: encode_png(noise_image(64, 64, 1))[:40] + b"\x00" * 400, "not an accepted image"),
    "bomb": (_bomb, "decompression bomb"),
    # HF's processor refuses it too (a side would shrink under 10 px): refused from its size, before the
    # tower runs
    "too_thin": (lambda: encode_png(noise_image(5000, 8, 2)), "too extreme"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument_and_the_service_goes_on(encoder, case):
    make, words = BAD[case]
    calls, misses = encoder.servicer.vision.calls, encoder.stats().misses
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(encode_request(encode_png(noise_image(50, 60, 3)), make()), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 1" in err.value.details() and words in err.value.details()
    assert encoder.servicer.vision.calls == calls, "nothing is encoded when an input is bad"
    assert encoder.stats().misses == misses, "nor is the good image 0 queued for the tower"
    assert len(encoder.servicer.pending) == 0, "the request's files are no longer pending"
    ok = encoder.stub.Encode(encode_request(encode_png(noise_image(80, 90, 4))), timeout=60)
    assert ok.embeddings[0].shape[0] == encoder.servicer.vision.layout.tokens_for_size(80, 90)
    encoder.release_all(ok)
