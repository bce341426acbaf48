"""Qwen3-VL through the encoder service (a real gRPC server in-process, CPU, SHM arena): each image is one
cache entry holding every part, EmbeddingRef.shape = [parts, rows, hidden], and each part's bytes equal
HF's get_image_features (merged features, then each DeepStack level) over SHM and inline alike."""

from __future__ import annotations

import grpc
import pytest
import torch

from common.families.qwen3_vl.encoder import Qwen3VisionEncoder
from common.images import ImageLimits, encode_png
from common.pb import common_pb2, encoder_pb2
from common.transport import import_embedding
from encoder_svc.config import EncoderConfig
from tests.encoder.conftest import EncoderHarness, encode_request

SHM, INLINE = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE
PARTS, HIDDEN = 4, 64  # qwen3-vl-tiny: merged + 3 DeepStack levels, text hidden 64
PIXEL_CAP = 1_000_000  # the server's --max-image-pixels here: every test image is below it


@pytest.fixture(scope="module")
def server(qwen3_model_dir):
    """One encoder on qwen3-vl-tiny (64 MiB cache: the largest image, 16384 rows x 4 parts, is 16 MiB)."""
    limits = ImageLimits(max_pixels=PIXEL_CAP, max_images_per_request=4)
    harness = EncoderHarness(EncoderConfig(model=qwen3_model_dir, cache_bytes=64 << 20, lease_ttl_s=30,
                                           limits=limits, decode_processes=0))
    yield harness
    harness.close()


@pytest.fixture
def encoder(server):
    """The module's encoder; after each test no lease may be left active."""
    yield server
    assert server.stats().active_leases == 0, "a test (or the server) leaked a lease"


@pytest.fixture(scope="module")
def hf(qwen3_oracle, qwen_images):
    """HF's [parts, rows, hidden] features and (t, h, w) grid of each test image."""
    pixel_values, grids = qwen3_oracle.pixels(qwen_images)
    return qwen3_oracle.image_features(pixel_values, grids), [g.tolist() for g in grids]


def _assert_parts_equal(ref: common_pb2.EmbeddingRef, expected: torch.Tensor, grid: list[int]) -> None:
    """ref's 3-D shape, grid and size, and each part's bytes equal to expected's."""
    rows = grid[0] * grid[1] * grid[2] // 4
    assert list(ref.shape) == [PARTS, rows, HIDDEN] == list(expected.shape)
    assert list(ref.grid_thw) == grid and ref.dtype == common_pb2.DTYPE_FLOAT32
    assert ref.nbytes == PARTS * rows * HIDDEN * 4
    got = import_embedding(ref)
    assert got.shape == (PARTS, rows, HIDDEN)
    for part in range(PARTS):
        assert got[part].numpy().tobytes() == expected[part].numpy().tobytes(), f"part {part} differs"


def test_one_image_is_one_entry_of_every_part_then_a_hit(encoder, hf, qwen_images):
    (features, grids), vision = hf, encoder.servicer.vision
    assert isinstance(vision, Qwen3VisionEncoder)
    data, encodes = encode_png(qwen_images[0]), encoder.stats().encodes
    first = encoder.stub.Encode(encode_request(data, accept=[SHM]), timeout=60)
    (ref,) = first.embeddings
    assert ref.WhichOneof("location") == "shm" and ref.lease_id and not ref.cache_hit
    _assert_parts_equal(ref, features[0], grids[0])
    ours = vision.encode([qwen_images[0]])[0]  # Qwen3VisionEncoder's own output, byte for byte
    assert import_embedding(ref).numpy().tobytes() == ours.contiguous().numpy().tobytes()
    stats = encoder.stats()
    assert stats.encodes == encodes + 1 and stats.active_leases == 1 and stats.leased_bytes >= ref.nbytes

    lookup = encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[ref.content_hash]), timeout=10)
    assert list(lookup.cached) == [True] and list(lookup.grids[0].thw) == grids[0]
    assert encoder.release_all(first) == 1
    stats = encoder.stats()
    assert stats.active_leases == 0 and stats.leased_bytes == 0

    again = encoder.stub.Encode(encode_request(data, accept=[INLINE]), timeout=60)
    by_hash = encoder.stub.Encode(encoder_pb2.EncodeRequest(
        images=[common_pb2.ImageInput(content_hash=ref.content_hash)], accept=[SHM]), timeout=60)
    for hit in (again.embeddings[0], by_hash.embeddings[0]):
        assert hit.cache_hit and hit.content_hash == ref.content_hash
        _assert_parts_equal(hit, features[0], grids[0])
    assert not again.embeddings[0].lease_id and again.embeddings[0].WhichOneof("location") == "inline_data"
    assert encoder.stats().encodes == encodes + 1, "hits must not run the vision tower"
    assert encoder.release_all(by_hash) == 1


@pytest.mark.parametrize("transport", [SHM, INLINE], ids=["shm", "inline"])
def test_three_images_of_different_sizes(encoder, hf, qwen_images, transport):
    features, grids = hf
    salt = f"three-{transport}"  # a key of its own per case: every image is a miss first
    datas = [encode_png(i) for i in qwen_images]
    encodes = encoder.stats().encodes
    cold = encoder.stub.Encode(encode_request(*datas, accept=[transport], cache_salt=salt), timeout=120)
    warm = encoder.stub.Encode(encode_request(*datas, accept=[transport], cache_salt=salt), timeout=120)
    assert encoder.stats().encodes == encodes + 3
    assert len({r.shape[1] for r in cold.embeddings}) == 3  # three row counts
    for response, hit in ((cold, False), (warm, True)):
        for ref, expected, grid in zip(response.embeddings, features, grids, strict=True):
            assert ref.cache_hit is hit
            assert ref.WhichOneof("location") == ("shm" if transport == SHM else "inline_data")
            _assert_parts_equal(ref, expected, grid)
    assert encoder.release_all(cold) + encoder.release_all(warm) == (6 if transport == SHM else 0)


def test_prefetch_and_a_concurrent_encode_share_one_tower_run(encoder, hf, qwen_images):
    features, grids = hf
    data, salt = encode_png(qwen_images[1]), "prefetch"
    encodes = encoder.stats().encodes
    accepted = encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(data=data)], cache_salt=salt), timeout=60).accepted
    assert accepted == 1
    response = encoder.stub.Encode(encode_request(data, accept=[SHM], cache_salt=salt), timeout=60)
    (ref,) = response.embeddings  # joined the prefetch in flight, or hit its entry
    _assert_parts_equal(ref, features[1], grids[1])
    assert encoder.stats().encodes == encodes + 1
    encoder.release_all(response)
    lookup = encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[ref.content_hash],
                                                           cache_salt=salt), timeout=10)
    assert list(lookup.cached) == [True] and list(lookup.grids[0].thw) == grids[1]


@pytest.mark.parametrize("case", ["over_pixel_cap", "max_pixels_above_model"])
def test_image_over_a_cap_is_invalid_argument(encoder, qwen_images, case):
    from PIL import Image

    good = common_pb2.ImageInput(data=encode_png(qwen_images[0]))
    if case == "over_pixel_cap":  # 1100 x 1000 > PIXEL_CAP: refused from its header
        bad = common_pb2.ImageInput(data=encode_png(Image.new("RGB", (1100, 1000))))
        words = f"more than the {PIXEL_CAP} pixels allowed"
    else:  # the model's max_pixels is 16777216 (preprocessor_config.json)
        bad = common_pb2.ImageInput(data=encode_png(qwen_images[2]), max_pixels=16777216 + 1)
        words = "max_pixels 16777217 is above"
    encodes = encoder.stats().encodes
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(encoder_pb2.EncodeRequest(images=[good, bad], accept=[SHM]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 1" in err.value.details() and words in err.value.details(), err.value.details()
    assert encoder.stats().encodes == encodes, "inputs are checked before any is encoded"
