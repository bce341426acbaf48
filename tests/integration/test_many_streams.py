"""500 concurrent streams against one pair on the tiny model: all finish without an error, and afterwards
no KV block or lease is left on either service. A fifth of the streams carry an image (ten distinct
images, so most are encoder cache hits and some prefix hits), and a tenth are cancelled by their
client midway, so finish, hit and cancel paths all run under load.

Bounded in time: the whole load must end within LOAD_TIMEOUT_S, or the test fails (a hang, not speed).
"""

from __future__ import annotations

import asyncio
import time

from common.client import AsyncDecoderClient, generate_request
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import make_image

NUM_STREAMS = 500
LOAD_TIMEOUT_S = 300
MAX_TOKENS = 6


async def _one(client: AsyncDecoderClient, i: int, images: list[bytes]) -> str:
    with_image = i % 5 == 0
    prompt = f"USER: {'<image>' if with_image else ''}\nstream {i} says ASSISTANT:"
    imgs = [images[(i // 5) % len(images)]] if with_image else []
    if i % 10 == 3:  # a client that goes away after its first message
        call = client.stub.Generate(_request(prompt, imgs, i), timeout=LOAD_TIMEOUT_S)
        async for _ in call:
            call.cancel()
            break
        return "cancelled"
    result = await client.generate_text(prompt, imgs, max_tokens=MAX_TOKENS, request_id=f"s{i}")
    assert len(result.token_ids) <= MAX_TOKENS and result.finish_reason in ("LENGTH", "STOP")
    return "finished"


def _request(prompt, imgs, i):
    return generate_request(prompt, imgs, request_id=f"s{i}", max_tokens=64, ignore_eos=True)


async def _load(address: str, images: list[bytes]) -> list:
    async with AsyncDecoderClient(address, timeout=LOAD_TIMEOUT_S) as client:
        return await asyncio.gather(*(_one(client, i, images) for i in range(NUM_STREAMS)),
                                    return_exceptions=True)


def test_500_concurrent_streams_finish_and_leave_nothing_behind(tiny_model_dir, tmp_path):
    pair = Pair(tiny_model_dir, tmp_path,
                decoder_args=["--num-kv-blocks", "1024", "--max-num-seqs", "64",
                              "--max-num-batched-tokens", "256"]).start()
    try:
        images = [png(make_image(300 + k)) for k in range(10)]
        started = time.monotonic()
        outcomes = asyncio.run(asyncio.wait_for(_load(pair.decoder.address, images), LOAD_TIMEOUT_S))
        seconds = time.monotonic() - started
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert not errors, f"{len(errors)} streams failed, first: {errors[0]!r}"
        assert outcomes.count("finished") == NUM_STREAMS - NUM_STREAMS // 10
        d, e = pair.wait_idle(timeout=60)
        print(f"\n{NUM_STREAMS} streams in {seconds:.1f} s; decoder: finished {d.requests_finished}, "
              f"aborted {d.requests_aborted}, failed {d.requests_failed}, images encoded {d.images_encoded}, "
              f"encoder hits {d.images_encoder_cache_hits}, "
              f"skipped by KV reuse {d.images_skipped_by_kv_reuse}")
        assert d.requests_failed == 0
        assert d.requests_finished + d.requests_aborted >= NUM_STREAMS
        assert (d.running, d.waiting, d.kv_blocks_used, d.active_leases) == (0, 0, 0, 0)
        assert e.active_leases == 0 and e.leased_bytes == 0
    finally:
        pair.stop()

