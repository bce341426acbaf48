"""Cross-service lookahead, a dead encoder, a full queue: shown through stats and statuses."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.client import DecoderClient
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import make_image

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def _busy_then_queue(pair: Pair, n_queued: int, seed0: int) -> list:
    """One long request occupies the only running slot; n_queued image requests queue behind it."""
    results: list = [None] * n_queued
    with DecoderClient(pair.decoder.address, timeout=300) as client:
        long_stream = client.generate("USER: Tell me everything. ASSISTANT:", max_tokens=300, ignore_eos=True)
        next(long_stream)  # running now

        def run(i):
            with DecoderClient(pair.decoder.address, timeout=300) as c:
                results[i] = c.generate_text(PROMPT, [png(make_image(seed0 + i))], max_tokens=4)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_queued)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        list(long_stream)
    return results


@pytest.mark.parametrize("ahead", [4, 0])
def test_lookahead_has_queued_images_ready_before_their_prefill(tiny_model_dir, tmp_path, ahead):
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=[
        "--max-num-seqs", "1", "--encoder-max-ahead", str(ahead)]).start()
    try:
        results = _busy_then_queue(pair, 3, seed0=100 + ahead)
        assert all(r.finish_reason in ("LENGTH", "STOP") for r in results)
        with pair.decoder_client() as dec, pair.encoder_client() as enc:
            d, e = dec.stats(), enc.stats()
        if ahead:
            # Each queued image was asked for while its request waited, and was ready when its
            # prefill came: the encoder worked while the decoder computed.
            assert d.images_prefetched == 3
            assert d.lookahead_ready_at_prefill == 3 and d.lookahead_waited_at_prefill == 0
            assert e.misses == 3  # prefetch did the encoding; prefill found it leased, not encoded again
        else:
            assert d.images_prefetched == 0 and d.lookahead_ready_at_prefill == 0
        d, e = pair.wait_idle()
        assert d.kv_blocks_used == 0 and d.active_leases == 0 and e.active_leases == 0
    finally:
        pair.stop()


def test_dead_encoder_gives_unavailable_then_recovers_after_restart(tiny_model_dir, tmp_path):
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--encoder-timeout", "3"]).start()
    try:
        with pair.decoder_client(timeout=60) as client:
            assert client.generate_text(PROMPT, [png(make_image(1))], max_tokens=4).usage.images == 1
            pair.encoder.stop(sig=9)  # SIGKILL: no goodbye
            started = time.monotonic()
            for seed in (2, 3):
                with pytest.raises(grpc.RpcError) as err:
                    client.generate_text(PROMPT, [png(make_image(seed))], max_tokens=4)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "unreachable" in err.value.details()
            assert time.monotonic() - started < 30  # failed by the retry policy, not hung
            # Text-only requests do not need the encoder and go on.
            text_only = client.generate_text("USER: hi ASSISTANT:", max_tokens=3)
            assert text_only.finish_reason in ("LENGTH", "STOP")
            d = client.stats()
            assert d.kv_blocks_used == 0 and d.active_leases == 0

            pair.encoder.start()  # same port
            result = client.generate_text(PROMPT, [png(make_image(4))], max_tokens=4)
            assert result.usage.images == 1 and len(result.token_ids) > 0
    finally:
        pair.stop()


def test_full_queue_is_resource_exhausted(tiny_model_dir, tmp_path):
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--max-num-seqs", "1", "--max-waiting", "1"]).start()
    try:
        with pair.decoder_client(timeout=120) as client:
            running = client.generate("USER: go on ASSISTANT:", max_tokens=400, ignore_eos=True)
            next(running)
            waiting = client.generate("USER: wait ASSISTANT:", max_tokens=2)
            deadline = time.monotonic() + 10
            while client.stats().waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as err:
                client.generate_text("USER: one too many ASSISTANT:", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.cancel()
            assert len(list(waiting)) >= 1
    finally:
        pair.stop()


def test_an_outage_fails_every_image_within_the_encoder_timeout(tiny_model_dir, tmp_path):
    """Three waves of images for the 8 fetch workers: each image fails within --encoder-timeout of its
    own first ask, naming no address. The window once ran per worker, so queued images failed at twice
    the timeout; with a margin of 0.6 s, a window restarted at each fetch fails the third wave (it starts
    only after two fetches ran their course), whereas one wave alone can end inside the margin because
    retries stop early when the next pause would cross the deadline."""
    timeout_s, margin_s, n = 2.0, 0.6, 24  # 24 images: 3 x the 8 fetch workers (RemoteEmbeddingSource)
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--encoder-timeout", str(timeout_s)]).start()
    try:
        pair.encoder.stop(sig=9)
        errors: list = [None] * n
        elapsed: list = [None] * n
        go = threading.Barrier(n)

        def run(i):
            with DecoderClient(pair.decoder.address, timeout=60) as c:
                go.wait()  # connected: the clock starts together, at the send
                started = time.monotonic()
                try:
                    c.generate_text(PROMPT, [png(make_image(100 + i))], max_tokens=2)
                except grpc.RpcError as exc:
                    errors[i] = exc
                elapsed[i] = time.monotonic() - started

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(e is not None and e.code() == grpc.StatusCode.UNAVAILABLE for e in errors)
        assert max(elapsed) < timeout_s + margin_s, sorted(elapsed)
        assert not any(pair.encoder.address.split(":")[-1] in (e.details() or "") for e in errors)
    finally:
        pair.stop()
