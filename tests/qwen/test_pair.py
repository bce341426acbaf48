"""Qwen2.5-VL through the running encoder and decoder services (and the gateway): tokens equal HF's,
bad images are one clear INVALID_ARGUMENT each, and nothing is held afterwards."""

from __future__ import annotations

import grpc
import pytest
from PIL import Image

from common.client import DecoderClient, GenerationResult, generate_request
from common.images import encode_png
from common.pb import common_pb2, encoder_pb2
from tests.integration.harness import Pair, free_port
from tests.qwen.test_parity import ONE, THREE

N = 10


@pytest.fixture(scope="module")
def qwen_pair(qwen_model_dir, tmp_path_factory):
    """Encoder + decoder on the tiny Qwen preset; chunks of 64 tokens split every image."""
    pair = Pair(qwen_model_dir, tmp_path_factory.mktemp("qwen-pair"),
                decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "64",
                              "--encoder-timeout", "30", "--max-image-tokens", "1024"]).start()
    yield pair
    pair.stop()


def _run(pair, prompt, images, **kw):
    with pair.decoder_client(timeout=300) as client:
        return client.generate_text(prompt, [encode_png(i) for i in images], max_tokens=N, **kw)


def test_three_images_equal_hf_and_repeat_reuses(qwen_pair, qwen_oracle, qwen_images):
    cold = _run(qwen_pair, THREE, qwen_images)
    assert cold.token_ids == qwen_oracle.generate(THREE, qwen_images, N)
    assert cold.usage.images == 3 and cold.usage.prompt_tokens > 64 + 391 + 396
    warm = _run(qwen_pair, THREE, qwen_images)
    assert warm.token_ids == cold.token_ids
    assert warm.usage.cached_prompt_tokens > 0 and warm.usage.images_skipped_by_kv_reuse == 3
    dec, enc = qwen_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and enc.active_leases == 0


def test_encoder_answers_grids(qwen_pair, qwen_images):
    """Encode's refs carry the grid, and Lookup answers it for a hash alone."""
    with qwen_pair.encoder_client() as enc:
        (ref,) = enc.encode([encode_png(qwen_images[2])]).embeddings
        assert list(ref.grid_thw) == [1, 22, 72] and list(ref.shape)[0] == 22 * 72 // 4
        response = enc.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[ref.content_hash]))
        assert list(response.cached) == [True] and list(response.grids[0].thw) == [1, 22, 72]


def test_lower_max_pixels_per_image(qwen_pair, qwen_oracle, qwen_images):
    request = generate_request(ONE, [encode_png(qwen_images[1])], max_tokens=N)
    request.images[0].max_pixels = 100_000
    result = GenerationResult()
    with qwen_pair.decoder_client(timeout=300) as client:
        for chunk in client.stub.Generate(request, timeout=300):
            result.add(chunk)
    assert result.token_ids == qwen_oracle.generate(ONE, [qwen_images[1]], N, [(3136, 100_000)])


@pytest.mark.parametrize("case", ["mismatch", "over_cap", "bad_range", "over_server_range", "unknown_hash"])
def test_bad_images_invalid_argument_nothing_held(qwen_pair, qwen_images, case):
    big = Image.new("RGB", (4200, 4100))  # 17.2M pixels: over the default 4096 x 4096 limit
    prompt, images = {"mismatch": (ONE, qwen_images[:2]), "over_cap": (ONE, [big]),
                      "bad_range": (ONE, qwen_images[:1]), "over_server_range": (ONE, qwen_images[:1]),
                      "unknown_hash": (ONE, [])}[case]
    request = generate_request(prompt, [encode_png(i) for i in images], max_tokens=N)
    if case == "unknown_hash":  # never sent here: its grid (hence its token count) is unknown
        request.images.add(content_hash="ab" * 32)
    if case == "bad_range":
        request.images[0].min_pixels = 2_000_000  # above the server's max (1024 tokens of 28x28)
    if case == "over_server_range":  # above the server's 802816, below the checkpoint's 12845056
        request.images[0].max_pixels = 1_000_000
    with qwen_pair.decoder_client(timeout=60) as client, pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert {"mismatch": "placeholder", "over_cap": "pixels allowed", "bad_range": "min_pixels",
            "over_server_range": "above the server's limit of 802816",
            "unknown_hash": "send the image bytes"}[case] in err.value.details()
    dec, enc = qwen_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and enc.active_leases == 0


def test_transports_carry_any_row_count(qwen_pair, qwen_images):
    """Inline and shared-memory refs of images of different row counts."""
    with qwen_pair.encoder_client() as enc:
        response = enc.encode([encode_png(i) for i in qwen_images], accept=(common_pb2.TRANSPORT_INLINE,))
        refs = response.embeddings
        assert [r.shape[0] for r in refs] == [64, 391, 396]


def test_hash_only_image_counted_from_the_encoders_grid(qwen_pair, qwen_oracle, qwen_images, tmp_path):
    """A second decoder that never saw the image's bytes tokenizes it by hash alone: its grid comes from
    the encoder's Lookup answer."""
    from tests.integration.harness import Service

    with qwen_pair.encoder_client() as enc:
        (ref,) = enc.encode([encode_png(qwen_images[0])]).embeddings
        enc.release([ref.lease_id])
    other = Service("decoder-2", ["decoder", "--model", str(qwen_pair.model_dir), "--encoder",
                                  qwen_pair.encoder.address, "--num-kv-blocks", "256"],
                    free_port(), tmp_path / "decoder-2.log")
    other.start()
    try:
        request = generate_request(ONE, [], max_tokens=N)
        request.images.add(content_hash=ref.content_hash)
        result = GenerationResult()
        with DecoderClient(other.address, timeout=300) as client:
            for chunk in client.stub.Generate(request, timeout=300):
                result.add(chunk)
        assert result.token_ids == qwen_oracle.generate(ONE, [qwen_images[0]], N)
        assert result.usage.images_encoder_cache_hits == 1
    finally:
        other.stop()
