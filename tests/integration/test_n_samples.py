"""GenerateRequest.n through the services: one call for n samples gives each choice the tokens of a
separate call seeded seed + i, asks the encoder for its image once, admits (prefills) the prompt once, and
leaves nothing held after it ends or is cancelled mid-stream."""

from __future__ import annotations

import pytest

from tests.integration.conftest import png
from tests.integration.harness import Pair

PROMPT = "USER: <image>\nWhat is in this picture, and what colours does it have? ASSISTANT:"
SEED = 77


@pytest.fixture(scope="module")
def samples_pair(tiny_model_dir, tmp_path_factory):
    p = Pair(tiny_model_dir, tmp_path_factory.mktemp("n_samples"),
             # the full warm-up (a GPU's default) too: the counters below are the users' requests' only
             decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "256",
                           "--warm-up", "full"]).start()
    yield p
    p.stop()


def _idle(pair) -> None:
    dec, enc = pair.wait_idle()
    assert (dec.running, dec.waiting, dec.kv_blocks_used, dec.active_leases) == (0, 0, 0, 0)
    assert enc.active_leases == 0


def test_the_full_warm_up_leaves_no_request_counted_and_no_prefix_cached(samples_pair):
    """The first test of the module (one worker runs a file's tests in order): the pair as it started."""
    with samples_pair.decoder_client() as client:
        stats = client.stats()
    assert (stats.requests_finished, stats.prefix_cache_queried_tokens, stats.kv_blocks_used,
            stats.kv_blocks_cached_free) == (0, 0, 0, 0)


def test_n_samples_match_separate_seeded_calls_with_one_encode_and_one_prefill(samples_pair, test_images):
    pair, n = samples_pair, 4
    image = png(test_images[0])
    sampling = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    with pair.decoder_client() as client:
        separate = [client.generate_text(PROMPT, [image], seed=SEED + i, cache_salt=f"separate-{i}",
                                         **sampling).token_ids for i in range(n)]
        _idle(pair)
        before_dec, before_enc = client.stats(), pair.encoder_client().stats()
        choices = client.generate_choices(PROMPT, [image], n=n, seed=SEED, cache_salt="together", **sampling)
        after_dec, after_enc = client.stats(), pair.encoder_client().stats()
    assert [c.token_ids for c in choices] == separate
    assert all(c.finish_reason == "LENGTH" for c in choices)
    prompt_tokens = choices[0].usage.prompt_tokens
    # One admission (one prompt looked up and prefilled), n - 1 samples forked from its KV.
    assert after_dec.prefix_cache_queried_tokens - before_dec.prefix_cache_queried_tokens == prompt_tokens
    assert after_dec.samples_forked - before_dec.samples_forked == n - 1
    assert after_dec.requests_finished - before_dec.requests_finished == n
    # The image went to the encoder once (a new salt: a miss, encoded by the tower), not once per choice.
    assert after_enc.hits + after_enc.misses - before_enc.hits - before_enc.misses == 1
    assert after_dec.images_encoded - before_dec.images_encoded == 1
    _idle(pair)


def test_a_cancel_mid_stream_ends_every_sample_and_frees_everything(samples_pair, test_images):
    pair, n = samples_pair, 6
    with pair.decoder_client() as client:
        before = client.stats()
        stream = client.generate(PROMPT, [png(test_images[1])], n=n, max_tokens=400, ignore_eos=True,
                                 temperature=1.0, seed=3, cache_salt="cancel")
        seen = set()
        for chunk in stream:
            seen.add(chunk.index)
            if len(seen) == n:
                break
        assert client.stats().running == n  # every sample is running: each holds its blocks
        stream.cancel()
    _idle(pair)
    with pair.decoder_client() as client:
        after = client.stats()
    assert after.requests_aborted - before.requests_aborted == n
