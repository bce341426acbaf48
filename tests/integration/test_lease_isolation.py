"""A queued request never reads a slice the encoder reused for another tenant's image.

The defect: a request queued behind a long one held a zero-copy view of its embedding; its lease
expired (--lease-ttl 1) before prefill reached it, another tenant's Encodes evicted the entry and wrote
their image into the slice, and the request answered about the other tenant's image. Now the decoder
copies each embedding out while its lease provably holds and gives the lease back at once.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.client import DecoderClient, EncoderClient
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import make_image

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
SLOT = 16 * 64 * 4  # one tiny-model embedding: 16 tokens x 64 hidden, fp32


def test_expired_leases_never_show_another_tenants_image(tiny_model_dir, tmp_path, oracle):
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=["--lease-ttl", "1", "--cache-bytes", str(4 * SLOT)],
                decoder_args=["--max-num-seqs", "1", "--encoder-max-ahead", "4"]).start()
    try:
        mine = [make_image(500 + i) for i in range(4)]
        results: list = [None] * 4
        with DecoderClient(pair.decoder.address, timeout=120) as client:
            long_stream = client.generate("USER: Tell me everything. ASSISTANT:", max_tokens=400,
                                          ignore_eos=True)
            next(long_stream)  # it holds the only running slot

            def run(i):
                with DecoderClient(pair.decoder.address, timeout=120) as c:
                    results[i] = c.generate_text(PROMPT, [png(mine[i])], max_tokens=8, cache_salt="tenant-a")

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while client.stats().images_prefetched < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)  # every lease of tenant A's embeddings has expired by now
            with EncoderClient(pair.encoder.address, timeout=30) as enc:  # tenant B fills the cache
                for seed in range(8):
                    refs = enc.encode([png(make_image(900 + seed))], cache_salt="tenant-b").embeddings
                    enc.release([r.lease_id for r in refs if r.lease_id])
            long_stream.cancel()
            for t in threads:
                t.join(120)
        for img, result in zip(mine, results, strict=True):
            assert result is not None
            oracle.assert_same_tokens(result.token_ids, PROMPT, [img], 8)
        dec, enc_stats = pair.wait_idle()
        assert dec.active_leases == 0 and enc_stats.active_leases == 0
    finally:
        pair.stop()


def test_a_cache_full_of_leased_entries_fails_fast(tiny_model_dir, tmp_path):
    """RESOURCE_EXHAUSTED from the encoder is retried for RetryPolicy.full_cache_wait_s (2 s), not for
    the whole encoder timeout (it once took 19 s)."""
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=["--cache-bytes", str(SLOT)],
                decoder_args=["--encoder-timeout", "20"]).start()
    try:
        with EncoderClient(pair.encoder.address, timeout=30) as holder:
            refs = holder.encode([png(make_image(700))], accept=(2,)).embeddings  # SHM: keeps its lease
            assert refs[0].lease_id
            with DecoderClient(pair.decoder.address, timeout=60) as client:
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    client.generate_text(PROMPT, [png(make_image(701))], max_tokens=2)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
                assert time.monotonic() - started < 5
            holder.release([refs[0].lease_id])
    finally:
        pair.stop()


def test_images_refused_together_by_a_one_slot_cache_retry_apart_and_are_all_served(tiny_model_dir,
                                                                                     tmp_path):
    """A full cache refuses every image but the one it admits; the refused ones retry (within the 2 s
    full-cache wait) until each has had its turn, and no lease is left behind. On an H200, with the
    decoder's GPU steps delayed (tests/gpu/test_lease_race_gpu.py), retries with equal pauses came back
    in waves that each admitted one image, and the last ones ran out of time; pauses are now jittered
    (test_full_cache_retries_are_jittered_and_bounded). On CPU the waves admit several images each, so
    this passes either way: it guards the liveness, the unit test the jitter."""
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=["--cache-bytes", str(SLOT)]).start()
    try:
        images = [make_image(800 + i) for i in range(12)]
        errors: list = []

        def serve(img):
            try:
                with DecoderClient(pair.decoder.address, timeout=120) as client:
                    client.generate_text(PROMPT, [png(img)], max_tokens=2)
            except grpc.RpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")

        threads = [threading.Thread(target=serve, args=(img,)) for img in images]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not errors, errors
        dec, enc = pair.wait_idle()
        assert dec.active_leases == 0 and enc.active_leases == 0
    finally:
        pair.stop()
