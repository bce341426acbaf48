"""Lookahead in the remote embedding source: prefetches (prefetch=True asks, for queued requests) run on a
thread pool of their own, so an image a running prefill waits for never queues behind images needed
later, and the reverse; a prefetched image whose prefill comes while it is still pending is raised to
demand priority once ("boost", DecoderStats.lookahead_boosted) without a second fetch of it; a cancelled
or failed request gives back every lease its prefetches took; an encoder that dies under a prefetch fails
the image within its deadline, never hangs it.

No encoder runs: a fake stub plays one. Its prefetch Encodes of a "queued" hash wait (a low-priority job
the encoder has not run) until a demand Encode of the same hash raises the job, as the real encoder does;
a "stalled" hash keeps every Encode of it waiting (a slow tower). Every wait is a bounded wait on an
event, so a broken mechanism fails a test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import grpc
import pytest
import torch

from common.pb import common_pb2, encoder_pb2
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from tests.encoders.fake_calls import FakeMethod

pytestmark = pytest.mark.timeout(60)

ENCODER = "127.0.0.1:1"  # never dialled: the fake stub answers
HIDDEN = 4
PROMPT_S = 2.0  # "promptly": far above a real fetch here (milliseconds), far below the fakes' own waits
WORKERS = 2


def _hash(name: str) -> str:
    return (name.encode().hex() * 64)[:64]


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__()
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Call:
    """One Encode the fake received: what was asked, and by which of the source's threads."""

    def __init__(self, request: encoder_pb2.EncodeRequest) -> None:
        self.content_hash = request.images[0].content_hash
        self.has_bytes = bool(request.images[0].data)
        self.prefetch = request.prefetch
        self.request_id = request.request_id
        self.thread = threading.current_thread().name


class _Release:
    def __init__(self, encoder: FakeEncoder) -> None:
        self.encoder = encoder

    def future(self, request, timeout=None, metadata=None):
        with self.encoder.cond:
            self.encoder.released.extend(request.lease_ids)
            self.encoder.released_asks.extend(request.request_ids)
            self.encoder.cond.notify_all()
        done: Future = Future()
        done.set_result(encoder_pb2.ReleaseResponse())
        return done


class FakeEncoder:
    """An encoder stub: records every Encode and Release, leases every embedding it hands out."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.calls: list[_Call] = []
        self.leased: list[str] = []
        self.released: list[str] = []
        self.released_asks: list[str] = []  # Release by the asks' request_ids (answers never read)
        self.queued: dict[str, threading.Event] = {}  # low-priority job not run until a demand ask
        self.stalled: dict[str, threading.Event] = {}  # every Encode of the hash waits
        self.failing: dict[str, grpc.StatusCode] = {}
        self.dead = False
        self.Release = _Release(self)
        self.Encode = FakeMethod(self._encode)

    def queue(self, *names: str) -> None:
        for name in names:
            self.queued[_hash(name)] = threading.Event()

    def stall(self, *names: str) -> None:
        for name in names:
            self.stalled[_hash(name)] = threading.Event()

    def open_all(self) -> None:
        for gate in [*self.queued.values(), *self.stalled.values()]:
            gate.set()

    def GetStats(self, request, timeout=None, metadata=None):  # noqa: N802 - gRPC's name
        if self.dead:
            raise _Status(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        return encoder_pb2.EncoderStats()

    def _encode(self, request, timeout=None, wait_for_ready=None, metadata=None):
        assert timeout is not None  # an Encode without a timeout could hang its worker forever
        call = _Call(request)
        with self.cond:
            self.calls.append(call)
            self.cond.notify_all()
        h = call.content_hash
        if self.dead:
            raise _Status(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
        if h in self.failing:
            raise _Status(self.failing[h], "cannot decode image")
        if h in self.queued:
            if not call.prefetch:
                self.queued[h].set()  # demand work for a queued job: the encoder runs it now
            elif not self.queued[h].wait(timeout):
                raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if h in self.stalled and not self.stalled[h].wait(timeout):
            raise _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        with self.cond:
            lease = f"lease-{len(self.leased)}"
            self.leased.append(lease)
        rows = torch.full((3, HIDDEN), float(len(h)))
        ref = common_pb2.EmbeddingRef(content_hash=h, shape=list(rows.shape), dtype=common_pb2.DTYPE_FLOAT32,
                                      nbytes=rows.numel() * 4, inline_data=rows.numpy().tobytes(),
                                      lease_id=lease, lease_expires_in_s=60.0)
        return encoder_pb2.EncodeResponse(embeddings=[ref])

    def encodes(self, name: str, prefetch: bool | None = None) -> list[_Call]:
        with self.cond:
            return [c for c in self.calls if c.content_hash == _hash(name)
                    and (prefetch is None or c.prefetch == prefetch)]

    def wait_arrived(self, name: str, prefetch: bool, timeout: float = PROMPT_S) -> None:
        """Until an Encode of `name` (of that priority) has reached the encoder."""
        with self.cond:
            assert self.cond.wait_for(lambda: any(c.content_hash == _hash(name) and c.prefetch == prefetch
                                                  for c in self.calls), timeout), \
                f"no {'prefetch' if prefetch else 'demand'} Encode of {name} arrived"

    def wait_all_released(self, timeout: float = PROMPT_S) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: set(self.released) == set(self.leased), timeout), \
                f"leases never given back: {sorted(set(self.leased) - set(self.released))}"
            assert len(self.released) == len(set(self.released))  # and none twice


class Harness:
    """A source wired to a FakeEncoder, counting per key the fetch (and boost) tasks that finished."""

    def __init__(self, monkeypatch, retry: RetryPolicy) -> None:
        self.encoder = FakeEncoder()
        self.source = RemoteEmbeddingSource([ENCODER], retry=retry, max_workers=WORKERS,
                                            lease_owner="test-owner")
        monkeypatch.setattr(self.source, "_stub", lambda encoder: self.encoder)
        self._done = threading.Condition()
        self.fetched: dict[tuple[str, str], int] = {}
        self.boosted: dict[tuple[str, str], int] = {}
        fetch, boost = self.source._fetch, self.source._boost

        def tracked_fetch(key, req):
            try:
                fetch(key, req)
            finally:
                self._count(self.fetched, key)

        def tracked_boost(encoder, req):  # counted once its answer is handled (the source's callback first)
            call = boost(encoder, req)
            call.add_done_callback(lambda _: self._count(self.boosted, (req.request_id, req.content_hash)))
            return call

        monkeypatch.setattr(self.source, "_fetch", tracked_fetch)
        monkeypatch.setattr(self.source, "_boost", tracked_boost)

    def _count(self, done: dict, key: tuple[str, str]) -> None:
        with self._done:
            done[key] = done.get(key, 0) + 1
            self._done.notify_all()

    def _wait(self, done: dict, key: tuple[str, str], times: int, timeout: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: done.get(key, 0) >= times, timeout)

    def ask(self, rid: str, name: str, prefetch: bool) -> None:
        self.source.request(EmbeddingRequest(rid, _hash(name), b"png bytes", prefetch=prefetch))

    def poll(self, rid: str, name: str) -> EmbeddingState:
        return self.source.poll(rid, _hash(name))

    def wait_fetched(self, rid: str, name: str, timeout: float = PROMPT_S, times: int = 1) -> None:
        """Until `times` fetch tasks of the key have ended (a task that finds the key taken ends too)."""
        assert self._wait(self.fetched, (rid, _hash(name)), times, timeout), \
            f"fetch of {name} for {rid} did not finish within {timeout} s"

    def wait_boosted(self, rid: str, name: str, timeout: float = PROMPT_S) -> None:
        """Until the boost of the key was answered and its answer handled."""
        assert self._wait(self.boosted, (rid, _hash(name)), 1, timeout), f"no boost of {name} ended"

    def close(self) -> None:
        self.encoder.open_all()
        self.source.close()


_RETRY = RetryPolicy(attempt_timeout_s=10.0, total_timeout_s=20.0, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def rig(monkeypatch):
    harness = Harness(monkeypatch, _RETRY)
    yield harness
    harness.close()


# -- separate pools ----------------------------------------------------------------------------------

def test_a_fetch_completes_while_every_prefetch_worker_is_blocked(rig):
    """Prefetches run on their own pool: with every prefetch worker blocked on a low-priority Encode (and
    more prefetches queued behind them), an image a prefill needs is fetched at once, on a fetch worker,
    and the blocked prefetches are still pending."""
    enc = rig.encoder
    enc.queue("p1", "p2", "p3")
    for i, name in enumerate(("p1", "p2", "p3")):
        rig.ask(f"q{i}", name, prefetch=True)
    enc.wait_arrived("p1", prefetch=True)
    enc.wait_arrived("p2", prefetch=True)  # both prefetch workers are taken; p3 waits here for one

    rig.ask("now", "d", prefetch=False)
    rig.wait_fetched("now", "d")
    assert rig.poll("now", "d") == EmbeddingState.READY
    assert [c.thread.startswith("embed-fetch") for c in enc.encodes("d")] == [True]
    assert all(c.thread.startswith("embed-prefetch") for c in enc.calls if c.prefetch)
    assert [rig.poll(f"q{i}", n) for i, n in enumerate(("p1", "p2", "p3"))] == [EmbeddingState.PENDING] * 3
    assert enc.encodes("p3") == []  # still queued behind the blocked prefetches, not sent


def test_a_prefetch_completes_while_every_fetch_worker_is_blocked(rig):
    """The reverse: fetches a prefill waits on (slow, every fetch worker blocked) do not hold lookahead
    back, so the next requests' images are still prefetched meanwhile."""
    enc = rig.encoder
    enc.stall("d1", "d2")
    rig.ask("r1", "d1", prefetch=False)
    rig.ask("r2", "d2", prefetch=False)
    enc.wait_arrived("d1", prefetch=False)
    enc.wait_arrived("d2", prefetch=False)

    rig.ask("next", "p", prefetch=True)
    rig.wait_fetched("next", "p")
    assert rig.poll("next", "p") == EmbeddingState.READY
    assert [c.thread.startswith("embed-prefetch") for c in enc.encodes("p")] == [True]
    assert rig.poll("r1", "d1") == rig.poll("r2", "d2") == EmbeddingState.PENDING
    assert rig.source.stats().images_prefetched == 1


# -- boost -------------------------------------------------------------------------------------------

def test_an_in_flight_prefetch_is_boosted_once_when_its_prefill_comes(rig):
    """An image whose low-priority Encode is queued at the encoder is raised when its request reaches
    prefill: one demand Encode by hash (no bytes, on a fetch worker), so it is ready without waiting for
    the unrelated prefetches queued before it. lookahead_boosted counts it once however often prefill
    asks, before or after it is ready; the image is fetched once (the prefetch's Encode delivers the
    rows: no second fetch), and the boost's own lease goes back."""
    enc = rig.encoder
    enc.queue("x", "u1", "u2")
    enc.stall("x")  # once raised, x still takes a moment: prefill's next steps ask while it is pending
    rig.ask("r1", "x", prefetch=True)
    rig.ask("r2", "u1", prefetch=True)
    rig.ask("r3", "u2", prefetch=True)
    enc.wait_arrived("x", prefetch=True)
    enc.wait_arrived("u1", prefetch=True)

    rig.ask("r1", "x", prefetch=False)  # prefill reached r1
    enc.wait_arrived("x", prefetch=False)
    for _ in range(3):  # the next steps ask again while x is pending: no second boost
        rig.ask("r1", "x", prefetch=False)
        assert rig.poll("r1", "x") == EmbeddingState.PENDING
    enc.stalled[_hash("x")].set()
    rig.wait_fetched("r1", "x")
    rig.wait_boosted("r1", "x")
    assert rig.poll("r1", "x") == EmbeddingState.READY
    assert rig.source.get("r1", _hash("x")).shape == (3, HIDDEN)
    assert rig.poll("r2", "u1") == rig.poll("r3", "u2") == EmbeddingState.PENDING  # not run first

    rig.ask("r1", "x", prefetch=False)  # and once it is ready, nothing more either
    stats = rig.source.stats()
    assert stats.lookahead_boosted == 1
    assert stats.embeddings_requested == 3 and stats.images_prefetched == 3
    prefetches, demands = enc.encodes("x", prefetch=True), enc.encodes("x", prefetch=False)
    assert len(prefetches) == 1 and len(demands) == 1
    assert not demands[0].has_bytes and not demands[0].thread.startswith("embed-")  # sent by the asker
    rig.source.release("r1")
    enc.wait_all_released()
    assert len(enc.leased) == 2  # the prefetch's lease and the boost's, both given back
    assert rig.source.stats().active_leases == 0


def test_boosts_hold_no_fetch_worker(rig):
    """A boost's answer comes only once its image is encoded, so nothing waits on it: with more boosted
    images outstanding than there are fetch workers, an image a prefill needs is still fetched at once."""
    enc = rig.encoder
    names = [f"slow{i}" for i in range(WORKERS + 1)]
    enc.queue(*names)
    enc.stall(*names)  # raised, each still takes its time: every boost stays unanswered meanwhile
    for i, name in enumerate(names[:WORKERS]):  # prefetches on every prefetch worker
        rig.ask(f"r{i}", name, prefetch=True)
        enc.wait_arrived(name, prefetch=True)
    for i, name in enumerate(names[:WORKERS]):
        rig.ask(f"r{i}", name, prefetch=False)  # their prefills came
        enc.wait_arrived(name, prefetch=False)

    rig.ask("now", "d", prefetch=False)
    rig.wait_fetched("now", "d")
    assert rig.poll("now", "d") == EmbeddingState.READY
    assert all(rig.poll(f"r{i}", name) == EmbeddingState.PENDING for i, name in enumerate(names[:WORKERS]))
    enc.open_all()
    for i, name in enumerate(names[:WORKERS]):
        rig.wait_fetched(f"r{i}", name)
        rig.wait_boosted(f"r{i}", name)
    assert rig.source.stats().lookahead_boosted == WORKERS
    for i in range(WORKERS):
        rig.source.release(f"r{i}")
    rig.source.release("now")
    enc.wait_all_released()  # the prefetches' leases and the boosts' alike


def test_a_prefetch_still_queued_here_is_fetched_at_once_when_its_prefill_comes(rig):
    """A prefetched image whose ask has not left this decoder yet (every prefetch worker busy with
    unrelated images) is not left behind them when its prefill comes: it is fetched at demand priority
    on a fetch worker, counted as boosted, and fetched once (its queued prefetch sends nothing when it
    finally runs)."""
    enc = rig.encoder
    enc.queue("u1", "u2")
    rig.ask("r1", "u1", prefetch=True)
    rig.ask("r2", "u2", prefetch=True)
    enc.wait_arrived("u1", prefetch=True)
    enc.wait_arrived("u2", prefetch=True)
    rig.ask("r3", "x", prefetch=True)  # queued here behind u1 and u2
    assert enc.encodes("x") == []

    rig.ask("r3", "x", prefetch=False)  # prefill reached r3
    deadline = time.monotonic() + PROMPT_S
    while rig.poll("r3", "x") != EmbeddingState.READY and time.monotonic() < deadline:
        time.sleep(0.005)  # bounded wait for a state (the fetch that makes it ready is not ours to hook)
    assert rig.poll("r3", "x") == EmbeddingState.READY, "a prefilling image waited for unrelated prefetches"
    assert rig.poll("r1", "u1") == rig.poll("r2", "u2") == EmbeddingState.PENDING
    assert rig.source.stats().lookahead_boosted == 1

    enc.open_all()  # the unrelated prefetches end; r3's queued prefetch runs and must send nothing
    rig.wait_fetched("r3", "x", times=2)  # the demand fetch and the queued prefetch
    assert [c.prefetch for c in enc.encodes("x")] == [False]
    assert rig.fetched[("r3", _hash("x"))] == 2
    assert rig.source.stats().lookahead_boosted == 1


def test_a_prefetch_ready_before_its_prefill_is_not_boosted(rig):
    """Boost is for pending work only: an image the lookahead already made ready sends nothing more when
    prefill asks for it, and counts as ready at prefill."""
    rig.ask("r1", "x", prefetch=True)
    rig.wait_fetched("r1", "x")
    rig.ask("r1", "x", prefetch=False)
    assert rig.poll("r1", "x") == EmbeddingState.READY
    stats = rig.source.stats()
    assert stats.lookahead_boosted == 0
    assert stats.lookahead_ready_at_prefill == 1 and stats.lookahead_waited_at_prefill == 0
    assert [c.prefetch for c in rig.encoder.encodes("x")] == [True]


def test_a_demand_fetch_is_never_boosted(rig):
    """Only images first asked for by lookahead are boosted: asking again for an image a prefill already
    waits on sends nothing (its Encode is demand work already)."""
    rig.encoder.stall("d")
    rig.ask("r1", "d", prefetch=False)
    rig.encoder.wait_arrived("d", prefetch=False)
    rig.ask("r1", "d", prefetch=False)
    rig.ask("r1", "d", prefetch=True)  # lookahead of a request already prefilling: nothing either
    rig.encoder.open_all()
    rig.wait_fetched("r1", "d")
    assert rig.source.stats().lookahead_boosted == 0
    assert len(rig.encoder.encodes("d")) == 1


# -- leases of requests that end early ----------------------------------------------------------------

def test_a_request_cancelled_while_its_images_are_prefetched_and_boosted_leaks_nothing(rig):
    """A request cancelled while its prefetch (and that prefetch's boost) is still at the encoder: the
    leases both Encodes bring back go back at once, the rows are not kept, and the source holds nothing
    of the request (no active lease, no slot, an UNKNOWN key)."""
    enc = rig.encoder
    enc.queue("x")
    enc.stall("x")  # once raised it still takes a while: the cancel lands while both calls are open
    rig.ask("r1", "x", prefetch=True)
    rig.ask("r1", "y", prefetch=True)
    enc.wait_arrived("x", prefetch=True)
    rig.wait_fetched("r1", "y")
    rig.ask("r1", "x", prefetch=False)
    enc.wait_arrived("x", prefetch=False)

    rig.source.release("r1")  # cancelled
    enc.open_all()
    rig.wait_fetched("r1", "x")
    rig.wait_boosted("r1", "x")
    enc.wait_all_released()
    assert len(enc.leased) == 3  # y's, x's prefetch's and the boost's
    assert rig.source.stats().active_leases == 0
    assert rig.poll("r1", "x") == rig.poll("r1", "y") == EmbeddingState.UNKNOWN
    with pytest.raises(KeyError):
        rig.source.get("r1", _hash("y"))
    assert rig.source._slots == {}


def test_a_request_cancelled_before_its_queued_prefetch_ran_sends_nothing(rig):
    """A prefetch still queued here when its request is cancelled is dropped: the encoder never gets the
    Encode (no work, no lease for a request that is gone)."""
    enc = rig.encoder
    enc.queue("u1", "u2")
    rig.ask("r1", "u1", prefetch=True)
    rig.ask("r2", "u2", prefetch=True)
    enc.wait_arrived("u1", prefetch=True)
    enc.wait_arrived("u2", prefetch=True)
    rig.ask("gone", "x", prefetch=True)
    rig.source.release("gone")
    enc.open_all()
    rig.wait_fetched("gone", "x")
    assert enc.encodes("x") == []
    enc.wait_all_released()
    assert rig.source.stats().active_leases == 0


def test_a_failed_request_whose_images_were_prefetched_leaks_nothing(rig):
    """One prefetched image fails (the encoder refuses it), so the request fails: the other prefetched
    image's lease went back, and releasing the request leaves nothing behind, not even its error code
    when nobody took it (a request failed or cancelled before its prefill)."""
    enc = rig.encoder
    enc.failing[_hash("bad")] = grpc.StatusCode.INVALID_ARGUMENT
    rig.ask("r1", "good", prefetch=True)
    rig.ask("r1", "bad", prefetch=True)
    rig.wait_fetched("r1", "good")
    rig.wait_fetched("r1", "bad")
    assert rig.poll("r1", "bad") == EmbeddingState.FAILED
    assert "cannot decode image" in rig.source.error("r1", _hash("bad"))
    assert rig.poll("r1", "good") == EmbeddingState.READY

    rig.source.release("r1")
    enc.wait_all_released()
    stats = rig.source.stats()
    assert stats.active_leases == 0 and stats.embedding_failures == 1
    assert rig.source._slots == {}
    assert rig.source.pop_error_code("r1") is None  # forgotten with the request


# -- a dead encoder ----------------------------------------------------------------------------------

def test_an_encoder_dead_during_a_prefetch_fails_the_later_fetch_within_the_deadline(monkeypatch):
    """An encoder that is down when lookahead asks, and stays down: the image's deadline runs from the
    prefetch, the prefill's ask of it does not restart it, its boost (which reaches nobody) is not
    counted, and the image fails UNAVAILABLE on time, holding no lease."""
    retry = RetryPolicy(attempt_timeout_s=0.2, total_timeout_s=0.6, initial_backoff_s=0.01,
                        max_backoff_s=0.05)
    rig = Harness(monkeypatch, retry)
    try:
        rig.encoder.dead = True
        asked = time.monotonic()
        rig.ask("r1", "x", prefetch=True)
        rig.encoder.wait_arrived("x", prefetch=True)
        rig.ask("r1", "x", prefetch=False)  # prefill comes while the prefetch retries
        rig.wait_fetched("r1", "x", timeout=retry.total_timeout_s + PROMPT_S)
        assert time.monotonic() - asked < retry.total_timeout_s + PROMPT_S
        assert rig.poll("r1", "x") == EmbeddingState.FAILED
        assert "unreachable" in rig.source.error("r1", _hash("x"))
        assert rig.source.pop_error_code("r1") == "UNAVAILABLE"
        stats = rig.source.stats()
        assert stats.lookahead_boosted == 0 and stats.active_leases == 0 and stats.embedding_failures == 1
        assert rig.encoder.leased == []
    finally:
        rig.close()


def test_a_prefetch_failed_on_a_dead_encoder_fails_its_prefill_at_once(monkeypatch):
    """The failure of a prefetch stands for its key (the image's deadline ran from the first ask): the
    prefill's ask sends nothing more and sees FAILED with UNAVAILABLE at once, so the request fails
    cleanly instead of hanging."""
    retry = RetryPolicy(attempt_timeout_s=0.1, total_timeout_s=0.3, initial_backoff_s=0.01,
                        max_backoff_s=0.05)
    rig = Harness(monkeypatch, retry)
    try:
        rig.encoder.dead = True
        rig.ask("r1", "x", prefetch=True)
        rig.wait_fetched("r1", "x", timeout=retry.total_timeout_s + PROMPT_S)
        sent = len(rig.encoder.calls)
        rig.ask("r1", "x", prefetch=False)
        assert rig.poll("r1", "x") == EmbeddingState.FAILED
        assert rig.source.pop_error_code("r1") == "UNAVAILABLE"
        assert len(rig.encoder.calls) == sent
        assert rig.source.stats().lookahead_boosted == 0
    finally:
        rig.close()


# -- answers never read --------------------------------------------------------------------------------

def test_an_image_released_while_its_encode_is_in_flight_gives_back_that_asks_leases(rig):
    """Its Encode is cancelled, and an answer already on its way would be dropped unread with a lease no
    one knows: the source also releases by the ask's request_id, which is its own (the same image asked
    for again is another ask)."""
    enc = rig.encoder
    enc.stall("x")
    rig.ask("r1", "x", prefetch=False)
    enc.wait_arrived("x", prefetch=False)
    (first,) = enc.encodes("x")
    assert first.request_id.startswith("r1#")
    rig.source.release("r1")
    with enc.cond:
        assert enc.cond.wait_for(lambda: enc.released_asks == [first.request_id], PROMPT_S)
    rig.ask("r1", "x", prefetch=False)  # asked for again after its release
    with enc.cond:
        assert enc.cond.wait_for(lambda: len(enc.calls) == 2, PROMPT_S)
    assert enc.calls[1].request_id.startswith("r1#") and enc.calls[1].request_id != first.request_id
    enc.open_all()
    rig.wait_fetched("r1", "x", times=2)
    rig.source.release("r1")
    enc.wait_all_released()
