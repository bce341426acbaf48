"""A decoder with two encoders routes each image to one of them by its content hash."""

from __future__ import annotations

from common.client import EncoderClient
from tests.integration.conftest import png
from tests.integration.harness import Pair, Service, free_port
from tests.oracle import make_image

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def test_images_are_spread_over_two_encoders_and_each_lives_in_one(tiny_model_dir, tmp_path):
    second = Service("encoder2", ["encoder", "--model", str(tiny_model_dir)], free_port(),
                     tmp_path / "encoder2.log")
    second.start()
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--encoder", second.address])
    try:
        pair.start()
        images = [png(make_image(300 + i)) for i in range(8)]
        with pair.decoder_client() as client:
            # The image ends past the first full KV block, so round two asks the encoder again.
            for _ in range(2):
                for i, image in enumerate(images):
                    client.generate_text(PROMPT, [image], max_tokens=2, cache_salt=f"round-{i}")
        stats = []
        for address in (pair.encoder.address, second.address):
            with EncoderClient(address) as enc:
                stats.append(enc.stats())
        assert all(s.misses > 0 for s in stats)            # both encoders got work
        assert sum(s.misses for s in stats) == 8            # each image was encoded once, on one encoder
        assert sum(s.entries for s in stats) == 8
        assert sum(s.hits for s in stats) == 8              # round two went back to the same encoder
    finally:
        pair.stop()
        second.stop()
