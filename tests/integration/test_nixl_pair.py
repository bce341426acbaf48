"""The decoder service reads its embeddings from the encoder service over NIXL (UCX between the two
processes), as it would from an encoder on another host: the encoder's arena is private (no shared
memory to hand out) and registered with a NIXL agent (--nixl). Tokens equal HF's for LLaVA, Qwen2.5-VL
(images of different sizes) and Qwen3-VL (multi-part DeepStack embeddings, images and a video), every
input came by NIXL, and no lease is left. A READ that fails falls back to the bytes, with the lease
given back."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.client import AsyncDecoderClient, EncoderClient, GenerationResult, generate_request
from common.pb import common_pb2
from common.transport import nixl as nixl_transport
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import make_image
from tests.qwen.test_parity import THREE as QWEN_THREE
from tests.qwen3.test_generate_parity import THREE
from tests.video.test_engine_video import MIXED_PROMPT, VIDEO, VideoOracle

if not nixl_transport.nixl_installed():
    pytest.skip("the nixl extra is not installed (pip install -e '.[nixl]')", allow_module_level=True)

PROMPT_2 = "USER: <image>\nCompare with <image>\nWhich is brighter? ASSISTANT:"
N = 12
ACROSS_HOSTS = ["--arena", "private", "--nixl"]  # no SHM segment: what an encoder on another host offers


def _nixl_pair(model_dir, workdir) -> Pair:
    return Pair(model_dir, workdir, encoder_args=ACROSS_HOSTS,
                decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "64",
                              "--encoder-timeout", "30", "--max-image-tokens", "1024",
                              # every image read over NIXL: none from an earlier request's kept rows
                              "--embedding-retain-bytes", "0"]).start()


@pytest.fixture(scope="module")
def llava_pair(tiny_model_dir, tmp_path_factory):
    pair = _nixl_pair(tiny_model_dir, tmp_path_factory.mktemp("nixl-llava"))
    yield pair
    pair.stop()


def _transports(pair) -> dict[str, int]:
    with pair.decoder_client() as client:
        return dict(client.stats().embedding_transports)


def test_llava_over_nixl_equals_hf_and_leaves_no_lease(llava_pair, oracle, test_images):
    assert "transports inline,nixl" in llava_pair.encoder.log_tail(200)  # the ready line says so
    assert "transports shm,nixl,inline" in llava_pair.decoder.log_tail(200)  # what the decoder asks for
    with llava_pair.encoder_client() as enc:
        assert enc.stats().transports == "inline,nixl"  # and its stats
    images = test_images[:2]
    with llava_pair.decoder_client(timeout=300) as client:
        cold = client.generate_text(PROMPT_2, [png(i) for i in images], max_tokens=N)
        oracle.assert_same_tokens(cold.token_ids, PROMPT_2, images, N)
        # Other images of the cache, asked for with the agent known: no metadata, same READ path.
        other = client.generate_text(PROMPT_2, [png(i) for i in test_images[2:4]], max_tokens=N,
                                     cache_salt="other")
        oracle.assert_same_tokens(other.token_ids, PROMPT_2, test_images[2:4], N)
    assert _transports(llava_pair) == {"nixl": 4}  # every image by NIXL, none inline
    dec, enc = llava_pair.wait_idle()
    assert dec.active_leases == 0 and enc.active_leases == 0 and dec.kv_blocks_used == 0


async def _storm(address: str, images: list[bytes]) -> list[str]:
    """40 streams with an image each; every other one cancelled by its client: half right after it is
    sent (while its image is fetched), half after its first message."""
    async def one(client: AsyncDecoderClient, i: int) -> str:
        request = generate_request("USER: <image>\nstorm ASSISTANT:", [images[i % len(images)]],
                                   request_id=f"storm{i}", max_tokens=8, cache_salt="storm")
        call = client.stub.Generate(request, timeout=300)
        if i % 4 == 1:
            await asyncio.sleep(0)
            call.cancel()
            return "cancelled"
        async for _ in call:
            if i % 4 == 3:
                call.cancel()
                return "cancelled"
        return "finished"

    async with AsyncDecoderClient(address, timeout=300) as client:
        return await asyncio.gather(*(one(client, i) for i in range(40)), return_exceptions=True)


def test_cancel_storm_over_nixl_leaves_no_lease_or_block(llava_pair):
    images = [png(make_image(700 + k)) for k in range(8)]
    before = _transports(llava_pair)
    outcomes = asyncio.run(_storm(llava_pair.decoder.address, images))
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not errors, f"{len(errors)} streams failed, first: {errors[0]!r}"
    assert outcomes.count("finished") == 20
    after = _transports(llava_pair)
    assert after.get("nixl", 0) > before.get("nixl", 0) and "inline_data" not in after
    dec, enc = llava_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and dec.active_leases == 0 and enc.active_leases == 0


def test_failed_read_falls_back_to_bytes_and_releases_the_lease(llava_pair, test_images, monkeypatch):
    """A READ that fails (here: refused by a stand-in reader) makes the source give the lease back and
    ask for the bytes: the image is READY with the encoder's rows, counted as inline."""
    image = png(test_images[3])
    with EncoderClient(llava_pair.encoder.address) as enc:
        (want,) = enc.encode([image], accept=[common_pb2.TRANSPORT_INLINE], cache_salt="fb").embeddings
    reads = []

    def failing(loc, nbytes, source=None, device=None):
        reads.append(loc.agent_name)
        raise nixl_transport.NixlTransferError("READ refused (test)")

    monkeypatch.setattr(nixl_transport, "read_slice", failing)
    source = RemoteEmbeddingSource([llava_pair.encoder.address], retry=RetryPolicy(total_timeout_s=30),
                                   transports=[common_pb2.TRANSPORT_NIXL, common_pb2.TRANSPORT_INLINE])
    try:
        source.request(EmbeddingRequest("fb", want.content_hash, image, cache_salt="fb"))
        deadline = time.monotonic() + 60
        while source.poll("fb", want.content_hash) == EmbeddingState.PENDING and time.monotonic() < deadline:
            time.sleep(0.05)
        key = want.content_hash
        assert source.poll("fb", key) == EmbeddingState.READY, source.error("fb", key)
        rows = source.get("fb", key)
        assert rows.numpy().tobytes() == want.inline_data
        assert len(reads) == 1 and reads[0].startswith("mmserve-enc-")  # NIXL was tried first
        assert source.stats().embedding_transports == {"inline_data": 1}
        source.release("fb")
    finally:
        source.close()
    _, enc_stats = llava_pair.wait_idle()
    assert enc_stats.active_leases == 0


@pytest.fixture(scope="module")
def qwen_pair(qwen_model_dir, tmp_path_factory):
    pair = _nixl_pair(qwen_model_dir, tmp_path_factory.mktemp("nixl-qwen"))
    yield pair
    pair.stop()


def test_qwen25_images_of_three_sizes_over_nixl_equal_hf(qwen_pair, qwen_oracle, qwen_images):
    """Variable-size embeddings (Qwen2.5-VL: rows from each image's grid), one READ each."""
    with qwen_pair.decoder_client(timeout=300) as client:
        result = client.generate_text(QWEN_THREE, [png(i) for i in qwen_images], max_tokens=N)
    assert result.token_ids == qwen_oracle.generate(QWEN_THREE, qwen_images, N)
    assert _transports(qwen_pair) == {"nixl": 3}
    dec, enc = qwen_pair.wait_idle()
    assert dec.active_leases == 0 and enc.active_leases == 0


@pytest.fixture(scope="module")
def qwen3_pair(qwen3_model_dir, tmp_path_factory):
    pair = _nixl_pair(qwen3_model_dir, tmp_path_factory.mktemp("nixl-qwen3"))
    yield pair
    pair.stop()


def test_qwen3_multipart_over_nixl_equals_hf(qwen3_pair, qwen3_oracle, qwen_images):
    """Three images of different sizes, each [parts, rows, hidden] (DeepStack) in one NIXL READ."""
    with qwen3_pair.decoder_client(timeout=300) as client:
        result = client.generate_text(THREE, [png(i) for i in qwen_images], max_tokens=N)
    assert result.token_ids == qwen3_oracle.generate(THREE, qwen_images, N)
    assert _transports(qwen3_pair) == {"nixl": 3}
    dec, enc = qwen3_pair.wait_idle()
    assert dec.active_leases == 0 and enc.active_leases == 0


def test_qwen3_video_over_nixl_equals_hf(qwen3_pair, qwen3_oracle, qwen3_model_dir, qwen_images):
    """A video's entry (timestamped groups, DeepStack parts) travels the same way as an image's."""
    request = generate_request(MIXED_PROMPT, [png(qwen_images[0])], max_tokens=N)
    request.videos.add(data=VIDEO)
    before = _transports(qwen3_pair).get("nixl", 0)
    result = GenerationResult()
    with qwen3_pair.decoder_client(timeout=300) as client:
        for chunk in client.stub.Generate(request, timeout=300):
            result.add(chunk)
    oracle = VideoOracle(qwen3_oracle, qwen3_model_dir)
    assert result.token_ids == oracle.generate(MIXED_PROMPT, qwen_images[:1], [VIDEO], N)
    after = _transports(qwen3_pair)
    assert after.get("nixl", 0) - before == 2 and "inline_data" not in after  # the image and the video
    dec, enc = qwen3_pair.wait_idle()
    assert dec.active_leases == 0 and enc.active_leases == 0
