"""Phi-4-MM through the services (encoder + decoder processes, gRPC, the SHM arena): an image request runs
under the checkpoint's vision LoRA and a text request on the base model, each equal to the oracle; the
repeat of the image request reuses its KV under the adapter (GetStats counts hits per adapter)."""

from __future__ import annotations

import pytest

from common.images import encode_png
from tests.integration.harness import Pair
from tests.phi4mm.images import sample_images

N = 8
IMAGE_PROMPT = "<|user|>look at <|image|> and <|image|> then tell a story<|end|><|assistant|>"
TEXT_PROMPT = "<|user|>tell a story about the lighthouse and the harbour at night<|end|><|assistant|>"


@pytest.fixture(scope="module")
def phi4_pair(phi4_tiny_dir, tmp_path_factory):
    p = Pair(phi4_tiny_dir, tmp_path_factory.mktemp("phi4-pair"),
             decoder_args=["--num-kv-blocks", "256"]).start()
    yield p
    p.stop()


def test_image_and_text_requests_through_the_services(phi4_pair, phi4_oracle):
    images = [sample_images()[2], sample_images()[3]]  # landscape 1000x500, portrait 97x900
    files = [encode_png(im) for im in images]
    want_image = phi4_oracle.generate(IMAGE_PROMPT, images, N)
    assert want_image != phi4_oracle.generate(IMAGE_PROMPT, images, N, adapter=None)
    with phi4_pair.decoder_client() as client:
        first = client.generate_text(IMAGE_PROMPT, files, max_tokens=N)
        text = client.generate_text(TEXT_PROMPT, max_tokens=N)
        again = client.generate_text(IMAGE_PROMPT, files, max_tokens=N)
        stats = client.stats()
    assert list(first.token_ids) == list(again.token_ids) == want_image
    assert list(text.token_ids) == phi4_oracle.generate(TEXT_PROMPT, [], N)
    by_adapter = dict(stats.prefix_cache_hit_tokens_by_adapter)
    assert by_adapter["vision"] > 1000 and by_adapter.get("", 0) == 0
    phi4_pair.wait_idle()
