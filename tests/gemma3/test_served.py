"""Gemma 3 through the running encoder and decoder services: tokens equal HF's for one and two images
(files sent as PNG bytes, embeddings handed over by the encoder service), a repeat reuses the prefix (ending
inside an image) and the encoder's cache, and nothing is held afterwards."""

from __future__ import annotations

import pytest

from common.images import encode_png
from tests.gemma3.conftest import sample_images
from tests.gemma3.test_image_generate import CASES
from tests.integration.harness import Pair

N = 8


@pytest.fixture(scope="module")
def gemma3_pair(gemma3_tiny_dir, tmp_path_factory):
    """Encoder + decoder on gemma-3-tiny; 12-token chunks would cut every 16-token image."""
    pair = Pair(gemma3_tiny_dir, tmp_path_factory.mktemp("gemma3-pair"),
                decoder_args=["--num-kv-blocks", "256", "--max-num-batched-tokens", "12",
                              "--encoder-timeout", "30"]).start()
    yield pair
    pair.stop()


def _run(pair, prompt, images):
    with pair.decoder_client(timeout=300) as client:
        return client.generate_text(prompt, [encode_png(i) for i in images], max_tokens=N)


@pytest.mark.parametrize("case", ["one", "two"])
def test_served_tokens_equal_hf_and_repeat_reuses(gemma3_pair, gemma3_oracle, case):
    prompt, idx = CASES[case]
    images = [sample_images()[i] for i in idx]
    # The oracle's pixels come from the PIL processor on the decoded PNG, as the service sees it.
    cold = _run(gemma3_pair, prompt, images)
    assert cold.token_ids == gemma3_oracle.generate(prompt, images, N)
    assert cold.usage.images == len(images)
    warm = _run(gemma3_pair, prompt, images)
    assert warm.token_ids == cold.token_ids
    # The images sit near the prompt's end: the cached blocks end before or inside the last one.
    assert warm.usage.cached_prompt_tokens > 0 and warm.usage.images_encoder_cache_hits >= 1
    dec, enc = gemma3_pair.wait_idle()
    assert dec.kv_blocks_used == 0 and enc.active_leases == 0
