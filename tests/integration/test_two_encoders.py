"""A decoder with two encoders routes each image to one of them by its content hash."""

from __future__ import annotations

import signal

from common.checkpoint import model_fingerprint
from common.client import EncoderClient
from common.hashing import hash_image_file
from decoder_svc.encoders.routing import HashRing
from tests.integration.conftest import png
from tests.integration.harness import Pair, Service, free_port
from tests.oracle import make_image

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def test_images_are_spread_over_two_encoders_and_each_lives_in_one(tiny_model_dir, tmp_path):
    second = Service("encoder2", ["encoder", "--model", str(tiny_model_dir)], free_port(),
                     tmp_path / "encoder2.log")
    second.start()
    # round two must ask an encoder again, not take the rows the decoder kept from round one
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--encoder", second.address,
                                                        "--embedding-retain-bytes", "0"])
    try:
        pair.start()
        # Ports are random, so the ring differs per run: pick 4 images that it routes to each encoder
        # (8 random ones all landed on one encoder in about 1 run of 128).
        ring = HashRing([pair.encoder.address, second.address])
        fingerprint = model_fingerprint(tiny_model_dir)
        chosen: dict[str, list[tuple[int, bytes]]] = {pair.encoder.address: [], second.address: []}
        seed = 300
        while min(len(v) for v in chosen.values()) < 4:
            image = make_image(seed)
            owner = ring.route(hash_image_file(png(image), fingerprint, f"img-{seed}"))
            if len(chosen[owner]) < 4:
                chosen[owner].append((seed, png(image)))
            seed += 1
        images = [item for items in chosen.values() for item in items]
        with pair.decoder_client() as client:
            # The image ends past the first full KV block, so round two asks the encoder again.
            for _ in range(2):
                for seed, image in images:
                    client.generate_text(PROMPT, [image], max_tokens=2, cache_salt=f"img-{seed}")
        stats = []
        for address in (pair.encoder.address, second.address):
            with EncoderClient(address) as enc:
                stats.append(enc.stats())
        assert [s.misses for s in stats] == [4, 4]          # each image went where the ring says
        assert sum(s.misses for s in stats) == 8            # each image was encoded once, on one encoder
        assert sum(s.entries for s in stats) == 8
        # Round two went back to the same encoder (a miss elsewhere would show above). Round one may add
        # hits of its own: the front end's send-ahead Prefetch makes the miss, and the core's ask by hash
        # that follows joins that work, or hits when the tiny tower has already finished it.
        assert all(s.hits >= 4 for s in stats)
    finally:
        pair.stop()
        second.stop()


def test_an_image_whose_encoder_was_killed_is_encoded_by_the_other(tiny_model_dir, tmp_path):
    # Issue 67: with two fixed --encoder addresses, a kill -9'd encoder stayed in the ring, so its images
    # were asked of it until --encoder-timeout and failed UNAVAILABLE; now it is ejected on failed health
    # checks and the Encode is retried on the other encoder (idempotent: keyed by content hash).
    second = Service("encoder2", ["encoder", "--model", str(tiny_model_dir)], free_port(),
                     tmp_path / "encoder2.log")
    second.start()
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--encoder", second.address,
                                                         "--encoder-resolve-interval", "0.5",
                                                         "--encoder-timeout", "10"])
    try:
        pair.start()
        ring = HashRing([pair.encoder.address, second.address])
        fingerprint = model_fingerprint(tiny_model_dir)
        seed = 900
        while ring.route(hash_image_file(png(make_image(seed)), fingerprint, "")) != pair.encoder.address:
            seed += 1
        pair.encoder.stop(signal.SIGKILL)
        with pair.decoder_client() as client:
            result = client.generate_text(PROMPT, [png(make_image(seed))], max_tokens=2, ignore_eos=True)
        assert len(result.token_ids) == 2 and result.finish_reason == "LENGTH"
        with EncoderClient(second.address) as enc:
            assert enc.stats().misses == 1  # the killed encoder's image, encoded here
    finally:
        pair.stop()
        second.stop()
