"""The encoder service through a real grpc.aio server on 127.0.0.1: results, cache, dedup, errors."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client import generate_latest

from common.images import ImageLimits, decode_image
from common.pb import common_pb2, encoder_pb2
from common.transport import import_embedding
from encoder_svc.server import EncoderConfig, EncoderServicer
from tests.encoder.conftest import EncoderHarness, encode_request, image_bytes

SHM, INLINE, CUDA = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE, common_pb2.TRANSPORT_CUDA_IPC


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_health_serving_after_warm_up(encoder):
    stub = health_pb2_grpc.HealthStub(encoder.channel)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert encoder.servicer.vision.calls >= 1  # the warm-up ran the tower


def test_encode_values_then_repeat_is_a_hit_with_no_tower_work(encoder):
    data = image_bytes(100)
    vision = encoder.servicer.vision
    expected = vision.encode([decode_image(data)])[0]
    calls = vision.calls
    first = encoder.stub.Encode(encode_request(data, accept=[CUDA, SHM, INLINE]), timeout=30)
    assert vision.calls == calls + 1
    ref = first.embeddings[0]
    assert ref.WhichOneof("location") == "shm"  # CUDA IPC is not served by a CPU encoder: next choice
    assert not ref.cache_hit and ref.lease_id and ref.lease_expires_in_s > 0
    assert list(ref.shape) == [16, 64] and ref.dtype == common_pb2.DTYPE_FLOAT32
    torch.testing.assert_close(import_embedding(ref), expected, rtol=0, atol=0)

    again = encoder.stub.Encode(encode_request(data, accept=[INLINE]), timeout=30)
    by_hash = encoder.stub.Encode(encoder_pb2.EncodeRequest(
        images=[common_pb2.ImageInput(content_hash=ref.content_hash)], accept=[SHM]), timeout=30)
    assert vision.calls == calls + 1, "cache hits must not run the vision tower"
    inline = again.embeddings[0]
    assert inline.cache_hit and not inline.lease_id and inline.WhichOneof("location") == "inline_data"
    assert torch.equal(import_embedding(inline), expected)
    assert by_hash.embeddings[0].cache_hit and by_hash.embeddings[0].content_hash == ref.content_hash
    assert encoder.stats().active_leases == 2
    encoder.release_all(first)
    encoder.release_all(by_hash)

    lookup = encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[ref.content_hash, "ab" * 32]))
    assert list(lookup.cached) == [True, False]
    # the same pixels under another tenant's salt are a different key
    salted = encoder.stub.Encode(encode_request(data, cache_salt="tenant-b"), timeout=30)
    assert salted.embeddings[0].content_hash != ref.content_hash and not salted.embeddings[0].cache_hit
    encoder.release_all(salted)


def test_batch_of_images_in_one_request(encoder):
    datas = [image_bytes(200 + i, (30 + 7 * i, 30)) for i in range(3)]
    calls = encoder.servicer.vision.calls
    resp = encoder.stub.Encode(encode_request(*datas), timeout=30)
    expected = encoder.servicer.vision.encode([decode_image(d) for d in datas])
    assert encoder.servicer.vision.calls == calls + 2  # one batch for the request, one for `expected`
    for ref, e in zip(resp.embeddings, expected, strict=True):
        torch.testing.assert_close(import_embedding(ref), e, rtol=1e-6, atol=1e-6)
    encoder.release_all(resp)


def test_16_concurrent_encodes_of_one_new_image_run_the_tower_once(encoder):
    data = image_bytes(300)
    vision = encoder.servicer.vision
    calls, images = vision.calls, vision.images_encoded
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(
            lambda _: encoder.stub.Encode(encode_request(data), timeout=30), range(16)))
    assert vision.calls == calls + 1 and vision.images_encoded == images + 1
    hashes = {r.embeddings[0].content_hash for r in responses}
    leases = {r.embeddings[0].lease_id for r in responses}
    assert len(hashes) == 1 and len(leases) == 16
    first = import_embedding(responses[0].embeddings[0])
    assert all(torch.equal(import_embedding(r.embeddings[0]), first) for r in responses)
    for r in responses:
        encoder.release_all(r)


def test_prefetch_then_encode_is_a_hit(encoder):
    data = image_bytes(400)
    resp = encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(images=[common_pb2.ImageInput(data=data)]))
    assert resp.accepted == 1
    key = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        enc = encoder.stub.Encode(encode_request(data), timeout=30)
        key = enc.embeddings[0]
        encoder.release_all(enc)
        if key.cache_hit:
            break
        time.sleep(0.05)  # Encode may have joined the running prefetch: not yet a hit
    assert key is not None and key.cache_hit
    assert encoder.stats().prefetches >= 1


def test_release_of_unknown_leases_is_a_no_op(encoder):
    assert encoder.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=["nope", ""])).released == 0


def _bomb() -> bytes:
    # 9000 x 9000 = 81 Mpx, above Pillow's 64 Mpx limit, but only a few KiB as a 1-bit PNG.
    return _png(Image.new("1", (9000, 9000)))


BAD_DATA = {
    "empty": (b"", "empty"),
    "truncated": (image_bytes(1)[:60], "cannot decode"),
    # Refused from the header, before any decoding: the format allowlist (common/images.py).
    "corrupt": (image_bytes(1)[:40] + b"\x00" * 400, "not an accepted image format"),
    "not_an_image": (b"%PDF-1.4 certainly not an image", "not an accepted image format"),
    "bomb": (None, "decompression bomb"),
    "too_wide": (None, "exceeds the maximum side"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_image_is_invalid_argument_naming_its_index(encoder, case):
    data, words = BAD_DATA[case]
    if case == "bomb":
        data = _bomb()
    elif case == "too_wide":
        data = _png(Image.new("RGB", (12001, 2)))
    calls = encoder.servicer.vision.calls
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(encode_request(image_bytes(1), data), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 1" in err.value.details() and words in err.value.details()
    assert encoder.servicer.vision.calls == calls, "nothing is encoded when an input is bad"
    ok = encoder.stub.Encode(encode_request(image_bytes(2)), timeout=30)  # still serving
    encoder.release_all(ok)


def test_request_level_errors(encoder):
    def code_of(request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            encoder.stub.Encode(request, timeout=30)
        return err.value.code(), err.value.details()

    good = image_bytes(5)
    code, msg = code_of(encode_request(*[good] * 5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 4" in msg
    code, msg = code_of(encode_request())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no images" in msg
    for accept in ([common_pb2.TRANSPORT_UNSPECIFIED], [SHM, 99]):
        code, msg = code_of(encode_request(good, accept=accept))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown transport" in msg
    unknown = common_pb2.ImageInput(content_hash="0f" * 32)
    code, msg = code_of(encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=good), unknown]))
    assert code == grpc.StatusCode.NOT_FOUND and "image 1" in msg and "send the image bytes" in msg
    code, msg = code_of(encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(content_hash="xyz")]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "image 0" in msg
    # image 0 was leased before image 1 failed: the fixture checks that lease was given back


def test_metrics_exposed(encoder):
    resp = encoder.stub.Encode(encode_request(image_bytes(600)), timeout=30)
    encoder.release_all(resp)
    text = generate_latest(encoder.registry).decode()
    for name in ("mmserve_encoder_cache_hits_total", "mmserve_encoder_cache_misses_total",
                 "mmserve_encoder_cache_evictions_total", "mmserve_encoder_cache_bytes_used",
                 "mmserve_encoder_cache_leased_bytes", "mmserve_encoder_encode_latency_seconds_bucket",
                 "mmserve_encoder_vision_batches_total", "mmserve_encoder_cuda_graphs 0.0",
                 "mmserve_encoder_tower_graphs 0.0", "mmserve_encoder_device_memory_reserved_bytes 0.0"):
        assert name in text
    stats = encoder.stats()
    assert stats.misses >= 1 and stats.encodes >= 1 and stats.model_fingerprint
    # on a CPU: no graphs, no device memory (tests/gpu/test_pair_gpu.py reads the memory on CUDA)
    assert stats.tower_graphs == 0
    assert stats.device_memory_allocated_bytes == stats.device_memory_reserved_bytes == 0
    assert stats.cache_bytes_used > 0 and stats.cache_bytes_capacity == 1 << 20


def _metric_sums(text: str, name: str) -> dict[str, float]:
    """{label value: value} of every `name{...} value` sample line of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name) + 1:-1]] = float(value)
    return out


def test_stage_split_is_exported_and_adds_up_to_the_latency(encoder):
    """Each Encode's time split into stages (encoder_svc/stages.py): summed in GetStats, one histogram
    per stage on /metrics, and the stages of every Encode add up to its latency."""
    from encoder_svc.stages import STAGES

    before = encoder.stats()
    data = image_bytes(612)
    for _ in range(2):  # a miss (decoded, preprocessed, through the tower), then a hit
        encoder.release_all(encoder.stub.Encode(encode_request(data), timeout=30))
    # the tower thread adds a batch's phases (and counts it) after the device fence, which may come
    # after the Encode replied: wait for that batch (a bound on waiting, not a timing assertion)
    deadline = time.monotonic() + 30
    while encoder.stats().vision_batches == before.vision_batches and time.monotonic() < deadline:
        time.sleep(0.01)
    after = encoder.stats()
    assert after.encode_calls - before.encode_calls == 2
    assert set(after.stage_seconds) == set(STAGES)
    delta = {s: after.stage_seconds[s] - before.stage_seconds.get(s, 0.0) for s in STAGES}
    assert delta["decode"] > 0 and delta["preprocess"] > 0 and delta["tower"] > 0, delta
    assert min(delta.values()) >= 0
    text = generate_latest(encoder.registry).decode()
    stage_sums = _metric_sums(text, "mmserve_encoder_stage_seconds_sum")
    assert set(stage_sums) == {f'stage="{s}"' for s in STAGES}
    assert _metric_sums(text, "mmserve_encoder_stage_seconds_count")['stage="tower"'] == after.encode_calls
    latency = sum(_metric_sums(text, "mmserve_encoder_encode_latency_seconds_sum").values())
    assert sum(stage_sums.values()) == pytest.approx(latency, rel=1e-6)
    assert sum(after.stage_seconds.values()) == pytest.approx(latency, rel=1e-6)
    assert "mmserve_encoder_encode_stage_seconds_total" in text
    # the tower thread's own split (encoder_svc/stages.py: TOWER_THREAD_PHASES), over its batches
    from encoder_svc.stages import TOWER_THREAD_PHASES

    assert set(after.tower_thread_seconds) == set(TOWER_THREAD_PHASES)
    assert after.vision_batches - before.vision_batches == 1  # the hit ran no batch
    assert after.tower_thread_seconds["launch"] > before.tower_thread_seconds.get("launch", 0.0)
    assert 'mmserve_encoder_tower_thread_seconds_total{phase="launch"}' in text


def test_cache_full_of_leases_is_resource_exhausted_then_recovers(tiny_model_dir):
    # room for exactly two 4 KiB embeddings; leases expire quickly for the second half of the test
    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, cache_bytes=2 * 4096, lease_ttl_s=1.0))
    try:
        held = harness.stub.Encode(encode_request(image_bytes(1), image_bytes(2)), timeout=30)
        calls = harness.servicer.vision.calls
        with pytest.raises(grpc.RpcError) as err:
            harness.stub.Encode(encode_request(image_bytes(3)), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "image 0" in err.value.details()
        assert harness.servicer.vision.calls == calls  # refused before running the tower
        hit = harness.stub.Encode(encode_request(image_bytes(1), accept=[INLINE]), timeout=10)
        assert hit.embeddings[0].cache_hit  # leased entries are intact and still served
        time.sleep(1.2)  # nobody releases: the leases expire and unpin
        stats = harness.stats()
        assert stats.active_leases == 0 and stats.expired_leases == 2
        third = harness.stub.Encode(encode_request(image_bytes(3)), timeout=10)
        assert not third.embeddings[0].cache_hit and harness.stats().evictions == 1
        harness.release_all(third)
        del held
    finally:
        harness.close()


def test_cache_smaller_than_one_embedding_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="cannot hold one image"):
        EncoderServicer.build(EncoderConfig(model=tiny_model_dir, cache_bytes=1000,
                                            limits=ImageLimits()), registry=None)


# -- tenant isolation (issue 13) -------------------------------------------------------------------


def _by_hash(*hashes: str, salt: str = "", owner: str = "", accept=(SHM,)) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(content_hash=h) for h in hashes],
                                     accept=list(accept), cache_salt=salt, lease_owner=owner)


def _not_found(encoder, request) -> str:
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    return err.value.details()


def test_hash_of_another_salt_is_not_found_exactly_like_an_unknown_hash(encoder):
    data = image_bytes(700)
    made = encoder.stub.Encode(encode_request(data, cache_salt="tenant-a", lease_owner="a"), timeout=30)
    key = made.embeddings[0].content_hash
    unknown = "cd" * 32
    before = encoder.stats()
    for salt in ("tenant-b", ""):
        details = _not_found(encoder, _by_hash(key, salt=salt))
        # The same words as for a hash nobody ever sent: nothing tells "exists elsewhere" apart.
        assert details.replace(key, "H") == _not_found(encoder, _by_hash(unknown, salt=salt)).replace(
            unknown, "H")
        assert list(encoder.stub.Lookup(encoder_pb2.LookupRequest(
            content_hashes=[key, unknown], cache_salt=salt)).cached) == [False, False]
        prefetch = encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
            images=[common_pb2.ImageInput(content_hash=key)], cache_salt=salt))
        assert prefetch.accepted == 0
    after = encoder.stats()
    assert (after.hits, after.misses, after.active_leases) == (before.hits, before.misses, 1)

    # In a batch, the foreign hash fails the request (naming its index) and leaks no lease.
    own = image_bytes(701)
    batch = encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=own),
                                              common_pb2.ImageInput(content_hash=key)],
                                      accept=[SHM], cache_salt="tenant-b", lease_owner="b")
    assert _not_found(encoder, batch).startswith("image 1:")
    deadline = time.monotonic() + 10
    while encoder.stats().active_leases != 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # a lease of the failed request is dropped when its encode lands
    assert encoder.stats().active_leases == 1

    # Under its own salt the hash resolves to the same entry.
    again = encoder.stub.Encode(_by_hash(key, salt="tenant-a", owner="a"), timeout=30)
    assert again.embeddings[0].cache_hit and again.embeddings[0].content_hash == key
    torch.testing.assert_close(import_embedding(again.embeddings[0]), import_embedding(made.embeddings[0]),
                               rtol=0, atol=0)
    assert list(encoder.stub.Lookup(encoder_pb2.LookupRequest(
        content_hashes=[key.upper()], cache_salt="tenant-a")).cached) == [True]
    assert encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(content_hash=key)], cache_salt="tenant-a")).accepted == 1
    assert encoder.release_all(made, owner="a") + encoder.release_all(again, owner="a") == 2


def test_release_by_another_owner_leaves_the_lease_active(encoder):
    resp = encoder.stub.Encode(encode_request(image_bytes(710), lease_owner="alice"), timeout=30)
    lease = resp.embeddings[0].lease_id
    assert lease and encoder.stats().active_leases == 1
    for owner in ("mallory", ""):
        # Answered like an unknown id: 0, no error, and the lease stays.
        assert encoder.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=[lease], lease_owner=owner),
                                    timeout=10).released == 0
        assert encoder.stats().active_leases == 1
    assert encoder.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=[lease, "nope"], lease_owner="alice"),
                                timeout=10).released == 1
    s = encoder.stats()
    assert s.active_leases == 0 and s.leased_bytes == 0


def test_an_answer_never_read_is_released_by_its_request_id(encoder):
    """A decoder that cancels an Encode as its answer arrives never learns the lease ids: it releases by
    the ask's request_id, for its own owner only (request ids can be guessed; lease ids cannot)."""
    resp = encoder.stub.Encode(encode_request(image_bytes(715), lease_owner="alice", request_id="r-7#3"),
                               timeout=30)
    assert resp.embeddings[0].lease_id and encoder.stats().active_leases == 1
    for owner in ("mallory", ""):
        assert encoder.stub.Release(encoder_pb2.ReleaseRequest(request_ids=["r-7#3"], lease_owner=owner),
                                    timeout=10).released == 0
    assert encoder.stub.Release(encoder_pb2.ReleaseRequest(request_ids=["r-7#3"], lease_owner="alice"),
                                timeout=10).released == 1
    s = encoder.stats()
    assert s.active_leases == 0 and s.leased_bytes == 0


def test_anonymous_leases_are_released_only_anonymously(encoder):
    resp = encoder.stub.Encode(encode_request(image_bytes(720)), timeout=30)  # no lease_owner
    lease = resp.embeddings[0].lease_id
    assert encoder.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=[lease], lease_owner="bob"),
                                timeout=10).released == 0
    assert encoder.stats().active_leases == 1
    assert encoder.release_all(resp) == 1


def test_owned_requests_leave_no_lease_behind_on_inline_and_errors(encoder):
    # Leases the server takes and drops by itself (inline copies, failed requests) are the owner's too.
    inline = encoder.stub.Encode(encode_request(image_bytes(730), accept=[INLINE], lease_owner="o"),
                                 timeout=30)
    assert not inline.embeddings[0].lease_id
    bad = encode_request(image_bytes(731), b"not an image", lease_owner="o")
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert encoder.stats().active_leases == 0


def test_overlong_lease_owner_is_invalid_argument(encoder):
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(encode_request(image_bytes(740), lease_owner="x" * 257), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_owner" in err.value.details()


def test_overlong_cache_salt_is_invalid_argument(encoder):
    from common.pb import encoder_pb2

    salt = "s" * 257
    lookup = encoder_pb2.LookupRequest(content_hashes=["ab" * 32], cache_salt=salt)
    for call in (lambda: encoder.stub.Encode(encode_request(image_bytes(741), cache_salt=salt), timeout=30),
                 lambda: encoder.stub.Lookup(lookup, timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()


def test_clients_bind_leases_to_their_own_owner(encoder):
    import asyncio

    from common.client import AsyncEncoderClient, EncoderClient

    address = f"127.0.0.1:{encoder.port}"
    with EncoderClient(address, timeout=30) as a, EncoderClient(address, timeout=30) as b:
        assert a.lease_owner and a.lease_owner != b.lease_owner
        lease = a.encode([image_bytes(750)], accept=[SHM]).embeddings[0].lease_id
        assert b.release([lease]) == 0 and encoder.stats().active_leases == 1
        with EncoderClient(address, timeout=30, lease_owner=a.lease_owner) as a_again:
            assert a_again.release([lease]) == 1  # the owner is the secret, not the channel

    async def run_async() -> tuple[int, int]:
        async with AsyncEncoderClient(address, timeout=30) as c, AsyncEncoderClient(address, timeout=30) as d:
            ref = (await c.encode([image_bytes(751)], accept=[SHM], cache_salt="s")).embeddings[0]
            assert await c.lookup([ref.content_hash], cache_salt="s") == [True]
            assert await c.lookup([ref.content_hash]) == [False]
            return await d.release([ref.lease_id]), await c.release([ref.lease_id])

    assert asyncio.run(run_async()) == (0, 1)


class _Context:
    """A servicer context whose RPC ends after the handler answered: delivered, or cancelled by a caller
    that hung up first (a decoder cancelling an Encode it no longer needs)."""

    def __init__(self, cancelled: bool) -> None:
        self._cancelled, self.callbacks = cancelled, []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def cancelled(self) -> bool:
        return self._cancelled

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


@pytest.mark.parametrize("hung_up", [True, False])
def test_leases_of_an_answer_never_delivered_go_back(encoder, hung_up):
    context = _Context(cancelled=hung_up)
    resp = encoder.call(encoder.servicer.Encode(encode_request(image_bytes(740), image_bytes(741),
                                                               lease_owner="o"), context))
    assert all(r.lease_id for r in resp.embeddings) and encoder.stats().active_leases == 2
    context.end()
    assert encoder.stats().active_leases == (0 if hung_up else 2)
    if not hung_up:  # delivered: the caller's to release
        assert encoder.release_all(resp, "o") == 2


def test_an_inline_answer_holds_no_lease_to_give_back(encoder):
    context = _Context(cancelled=True)
    encoder.call(encoder.servicer.Encode(encode_request(image_bytes(742), accept=[INLINE]), context))
    assert context.callbacks == [] and encoder.stats().active_leases == 0


def _until_cached(encoder, key: str, salt: str) -> None:
    """Wait (counted in asks, bounded) until the entry of `key` under `salt` is in the cache."""
    for _ in range(3000):
        if encoder.stub.Lookup(encoder_pb2.LookupRequest(content_hashes=[key], cache_salt=salt),
                               timeout=10).cached[0]:
            return
        time.sleep(0.01)
    raise AssertionError("the file sent ahead never reached the cache")


@pytest.mark.parametrize("needed_now", [True, False])
def test_a_file_sent_ahead_makes_its_own_requests_encode_a_miss(encoder, needed_now):
    """A decoder sends a new file ahead (Prefetch, needed_now) and its request then asks by hash: that ask
    is the miss the file was (cache_hit false, no hit counted), found ready or not; the next ask is a hit.
    A plain Prefetch (lookahead) owes no miss: the first ask is a hit."""
    from common.hashing import hash_image_file

    data, salt = image_bytes(640 + needed_now), f"ahead-{needed_now}"
    key = hash_image_file(data, encoder.servicer.vision.fingerprint, salt)
    hits = encoder.stats().hits
    assert encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(
        images=[common_pb2.ImageInput(data=data)], cache_salt=salt, needed_now=needed_now),
        timeout=60).accepted == 1
    _until_cached(encoder, key, salt)
    by_hash = encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(content_hash=key)], cache_salt=salt,
                                        accept=[INLINE])
    first = encoder.stub.Encode(by_hash, timeout=30).embeddings[0]
    assert first.content_hash == key and first.cache_hit is not needed_now
    assert encoder.stats().hits == hits + (not needed_now)
    assert encoder.stub.Encode(by_hash, timeout=30).embeddings[0].cache_hit
    assert encoder.stats().hits == hits + 1 + (not needed_now)
