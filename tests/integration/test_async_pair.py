"""The services with asynchronous scheduling (the GPU's default, forced on here on a CPU): the engine core
launches each step before reading the previous one's tokens, and the stream still equals HF's; 16
concurrent requests, cancellations and stop strings leave nothing held."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from common.client import DecoderClient
from tests.integration.conftest import png
from tests.integration.harness import Pair

PROMPT_1 = "USER: <image>\nWhat is in this picture? ASSISTANT:"
PROMPT_2 = "USER: <image>\nCompare with <image>\nWhich is brighter? ASSISTANT:"
TEXT = "USER: Tell me a story about a red car. ASSISTANT:"
N = 12


@pytest.fixture(scope="module")
def async_pair(tiny_model_dir, tmp_path_factory):
    p = Pair(tiny_model_dir, tmp_path_factory.mktemp("async-pair"),
             decoder_args=["--num-kv-blocks", "96", "--max-num-batched-tokens", "48",
                           "--async-scheduling", "on", "--encoder-timeout", "5"]).start()
    yield p
    p.stop()


def test_concurrent_requests_equal_hf(async_pair, oracle, test_images):
    cases = [(TEXT, []), (PROMPT_1, [test_images[0]]), (PROMPT_2, [test_images[1], test_images[2]]),
             (PROMPT_1, [test_images[3]])]
    jobs = [cases[i % len(cases)] for i in range(16)]

    def run(job):
        prompt, images = job
        with DecoderClient(async_pair.decoder.address, timeout=300) as client:
            return client.generate_text(prompt, [png(i) for i in images], max_tokens=N)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, images), result in zip(jobs, results, strict=True):
        oracle.assert_same_tokens(result.token_ids, prompt, images, N)
        assert result.usage.completion_tokens == N
    dec, enc = async_pair.wait_idle()
    assert (dec.running, dec.waiting, dec.kv_blocks_used, dec.active_leases) == (0, 0, 0, 0)
    assert enc.active_leases == 0


def test_stop_strings_and_cancels_leave_nothing_held(async_pair, oracle, test_images):
    with DecoderClient(async_pair.decoder.address, timeout=120) as client:
        full = client.generate_text(TEXT, [], max_tokens=N)
        assert len(full.text) >= 6
        stop = full.text[len(full.text) // 2:][:2]  # the output reaches it: stops with a step in flight
        stopped = client.generate_text(TEXT, [], max_tokens=N, stop=[stop])
    assert stopped.finish_reason == "STOP" and stop not in stopped.text
    assert full.text.startswith(stopped.text)

    started = threading.Barrier(5)

    def run(i):
        with DecoderClient(async_pair.decoder.address, timeout=60) as client:
            stream = client.generate(PROMPT_1, [png(test_images[i % 4])], max_tokens=200, ignore_eos=True,
                                     cache_salt=f"cancel-{i}")
            next(stream)
            started.wait()
            stream.cancel()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    for t in threads:
        t.join()
    dec, enc = async_pair.wait_idle()
    assert (dec.running, dec.waiting, dec.kv_blocks_used, dec.active_leases) == (0, 0, 0, 0)
    assert enc.active_leases == 0 and dec.requests_aborted >= 4
