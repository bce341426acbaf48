"""The remote embedding source: image embeddings from encoder services over gRPC.

- Content-addressed: each image is first asked for by its hash; its bytes travel only when the encoder
  answers NOT_FOUND.
- No bytes through gRPC where it can: the decoder accepts CUDA IPC (same GPU), then shared memory (same
  host), then NIXL (any host, with the nixl extra), then inline bytes, and falls back by itself when a
  ref it got cannot be opened here (to NIXL or the bytes) or a NIXL READ fails (to the bytes).
- One copy, then the lease goes back: a fetched embedding is copied out of the encoder's arena at once
  (device to device on a GPU) and kept only if the copy finished while its lease provably held; the
  lease is released right after. A queued request therefore never reads a slice the encoder may have
  reused for another image, however long it waits.
- Cross-service lookahead: the scheduler hands over the images of the next queued requests with
  prefetch=True, so the encoder works (at low priority) while this decoder computes.
- Never hangs: each ask runs on a worker thread with deadlines and retries with exponential backoff; an
  encoder that stays down fails the key with UNAVAILABLE.
- Slow is not down: an Encode stays open while the encoder works on it (cancelling it would make the
  encoder drop the work, encoder_svc/video_lane.py). Every `attempt_timeout_s` without an answer the
  encoder is asked for its stats: one that answers is busy, and the call goes on, up to
  `busy_timeout_s` from the first ask (then DEADLINE_EXCEEDED: "busy", not "unavailable"); one that
  does not answer either is unreachable, and the call is cancelled and retried as before.
- Several encoders are routed by consistent hash of the content hash; `dns:///NAME:PORT` finds them by
  DNS and follows replicas as they come and go (discovery.py). An image whose encoder left the ring is
  asked of its new owner on the next retry.
- Leases are this source's own: one lease-owner secret per source (one per decoder, made by its front
  end so that it can give back what a killed engine core could not) goes on every Encode and Release, so
  no other client can release them and this one releases no one else's.
- Each Encode attempt asks under a name of its own (`request#n.k`): an answer lost on a broken link is
  given back by its attempt's name once the encoder answers again or the image's fetch ends, and the asks
  in flight at close are given back before the channels close; a late release never frees another
  attempt's lease.
- Security (docs/security.md): TLS or mutual TLS with `tls`; with `token`, this decoder authenticates as
  a service and names each call's tenant (from its scoped cache_salt), so the encoder scopes it too.
- A hash-only image (no bytes) that the encoder does not hold under the request's cache_salt fails the
  request with NOT_FOUND: the encoder never hands out another tenant's entry for a bare hash.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from common.client import CHANNEL_OPTIONS, new_lease_owner
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from common.security.client_auth import auth_metadata
from common.security.identity import tenant_of_salt
from common.security.tls import ClientTls, open_channel
from common.transport.importer import can_import, import_embedding, readable_transports
from common.transport.nixl import NixlTransferError, known_agent
from decoder_svc.encoders.discovery import EncoderPool, NoEncoderError
from decoder_svc.encoders.encode_items import EncodeItem, by_hash, with_bytes
from decoder_svc.encoders.fetch_slot import FetchSlot
from decoder_svc.encoders.leases import LeaseLapsedError, lease_held_through
from decoder_svc.encoders.retained import RetainedEmbeddings, retain_key
from decoder_svc.encoders.retry_policy import (
    ENCODER_STAGE,
    PROBE_TIMEOUT_S,
    RETRYABLE,
    STAGE_CODES,
    TRANSPORT_CODES,
    EncoderBusyError,
    EncoderLeftRing,
    EncoderUnavailableError,
    Released,
    RetryPolicy,
    Unresponsive,
)
from decoder_svc.encoders.side_stream import SideStreamCopier
from decoder_svc.encoders.source_stats import RemoteSourceStats
from decoder_svc.encoders.transport_choice import TransportChoice
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingSource, EmbeddingState

__all__ = ["EncoderBusyError", "EncoderUnavailableError", "LeaseLapsedError", "RemoteEmbeddingSource",
           "RemoteSourceStats", "RetryPolicy", "lease_held_through"]

log = logging.getLogger("mmserve.decoder.encoders")

# A file the front end sent ahead may reach its encoder after the engine's ask by hash (the ask is small,
# the file megabytes): the encoder waits up to this long for it before answering NOT_FOUND.
_SENT_AHEAD_WAIT_MS = 250
_CLOSE_RELEASE_TIMEOUT_S = 0.5  # the asks in flight at close, given back before the channels go


class RemoteEmbeddingSource(EmbeddingSource):
    """EmbeddingSource backed by one or more encoder services."""

    def __init__(self, addresses: list[str] | EncoderPool, device: torch.device | str = "cpu",
                 retry: RetryPolicy = RetryPolicy(), max_workers: int = 8,
                 transports: list[int] | None = None, lease_owner: str | None = None,
                 tls: ClientTls | None = None, token: str | None = None, retain_bytes: int = 0) -> None:
        self.device = torch.device(device)
        # Embeddings kept after their requests, for the next request with the same image (retained.py)
        self._retained = RetainedEmbeddings(retain_bytes)
        # Binds our leases to us at the encoder; never logged or sent anywhere but the encoders.
        self._lease_owner = new_lease_owner() if lease_owner is None else lease_owner
        self._token = token  # never logged
        self.retry = retry
        # The ring of encoders; with dns:/// targets it changes on a background thread.
        self.ring = addresses if isinstance(addresses, EncoderPool) else EncoderPool(addresses)
        self.ring.start()
        self._transports = TransportChoice(transports or readable_transports(self.device))
        # Short reconnect backoff: a restarted encoder is found again within a second, not minutes.
        self._channel_options = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 100),
                                 ("grpc.min_reconnect_backoff_ms", 100),
                                 ("grpc.max_reconnect_backoff_ms", 1000)]
        self._tls = tls
        self._channels: dict[str, grpc.Channel] = {}  # made on first use: discovered encoders come later
        self._stubs: dict[str, encoder_pb2_grpc.EncoderServiceStub] = {}
        # Fetch workers block on their Encode call until the image is encoded, so lookahead's asks get
        # threads of their own: queued behind them, an image needed now would wait for images needed later.
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="embed-fetch")
        self._prefetch_pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="embed-prefetch")
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str], FetchSlot] = {}
        self._failed_requests: dict[str, grpc.StatusCode] = {}
        self._closed = False
        self._open_calls: set[grpc.Future] = set()  # Encodes in flight: close() cancels them
        self._copiers: dict[int, SideStreamCopier] = {}  # one per fetch thread, on CUDA
        self._counters = RemoteSourceStats()
        self._asks = itertools.count()

    # -- EmbeddingSource ---------------------------------------------------------------------------
    def request(self, req: EmbeddingRequest) -> None:
        key = (req.request_id, req.content_hash)
        start = None  # what to start once the lock is let go
        with self._lock:
            if self._closed:
                return
            slot = self._slots.get(key)
            kept_as = retain_key(req)
            kept = self._retained.take(kept_as) if slot is None else None
            if kept is not None:  # this decoder still holds its rows: no Encode (a cache hit, ours)
                self._slots[key] = FetchSlot(status=EmbeddingState.READY, prefetch=req.prefetch, tensor=kept,
                                             cache_hit=True, started=True, retain_key=kept_as,
                                             transport="retained")
                self._counters.embeddings_retained_hits += 1
            elif slot is None:
                self._slots[key] = FetchSlot(prefetch=req.prefetch, retain_key=kept_as,
                                         deadline=time.monotonic() + self.retry.total_timeout_s,
                                         name=f"{req.request_id}#{next(self._asks)}")
                self._counters.embeddings_requested += 1
                self._counters.images_prefetched += int(req.prefetch)
                # Routes there: the ring may be empty for a while.
                pool = self._prefetch_pool if req.prefetch else self._pool
                start = functools.partial(pool.submit, self._fetch, key, req)
            elif (not req.prefetch and slot.prefetch and not slot.boosted
                  and slot.status == EmbeddingState.PENDING):
                # Asked for by lookahead and needed now, not ready yet: its Encode went out at low
                # priority, so tell the encoder it is demand work (it moves the queued job up). Not
                # sent yet (every prefetch worker busy): fetch it now on a fetch worker instead.
                if not slot.started:
                    slot.boosted = True
                    self._counters.lookahead_boosted += 1
                    start = functools.partial(self._pool.submit, self._fetch, key, req)
                elif slot.encoder:
                    slot.boosted = True
                    start = functools.partial(self._boost, slot.encoder, req)
        if start is not None:
            start()

    def poll(self, request_id: str, content_hash: str) -> EmbeddingState:
        with self._lock:
            slot = self._slots.get((request_id, content_hash))
            if slot is None:
                return EmbeddingState.UNKNOWN
            if not slot.polled:  # the scheduler's first look, when prefill reaches the image
                slot.polled = True
                if slot.prefetch:
                    ready = slot.status == EmbeddingState.READY
                    self._counters.lookahead_ready_at_prefill += int(ready)
                    self._counters.lookahead_waited_at_prefill += int(not ready)
            return slot.status

    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        with self._lock:
            slot = self._slots.get((request_id, content_hash))
            if slot is None or slot.status != EmbeddingState.READY or slot.tensor is None:
                raise KeyError(f"embedding {content_hash[:16]} for {request_id} is not ready")
            return slot.tensor

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        with self._lock:
            keys = ([(request_id, content_hash)] if content_hash is not None
                    else [k for k in self._slots if k[0] == request_id])
            cancelled, abandoned = [], []
            for key in keys:
                slot = self._slots.pop(key, None)
                if slot is None:
                    continue
                # Leases went back when the rows were copied; a fetch still in flight gives its own back.
                slot.released = True
                if slot.status == EmbeddingState.READY and slot.tensor is not None:
                    self._retained.keep(slot.retain_key, slot.tensor)
                slot.tensor = None
                if slot.call is not None:
                    cancelled.append((slot.call, slot.encoder, slot.ask))
                abandoned.extend(slot.abandoned)
                slot.abandoned = []
            if content_hash is None:  # the request is gone: nobody will ask for its error code
                self._failed_requests.pop(request_id, None)
        for call, encoder, ask in cancelled:
            # Nobody here needs the answer: the encoder stops the work if nobody else does. An answer
            # already on its way is dropped unread, so its lease is given back by the ask's name.
            call.cancel()
            self._release_asks(encoder, [ask])
        self._release_abandoned(abandoned)

    def error(self, request_id: str, content_hash: str) -> str:
        with self._lock:
            slot = self._slots.get((request_id, content_hash))
            return slot.error if slot is not None else ""

    def pop_error_code(self, request_id: str) -> str | None:
        """The gRPC status name the request's failed image calls for (e.g. "UNAVAILABLE"); forgets it."""
        with self._lock:
            code = self._failed_requests.pop(request_id, None)
        return code.name if code is not None else None

    def cache_hit(self, request_id: str, content_hash: str) -> bool:
        with self._lock:
            slot = self._slots.get((request_id, content_hash))
            return bool(slot and slot.cache_hit)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            requests = {rid for rid, _ in self._slots}
            calls, self._open_calls = list(self._open_calls), set()
            # Asks whose answers may be on their way or lost: given back by name below, before the
            # channels close (release() gives back nothing once closed). Every pending slot's latest
            # ask, not only those with a call tracked: the encoder may hold an Encode whose future is
            # not tracked yet, and a Release of a name never answered frees nothing.
            asks = [(slot.encoder, slot.ask) for slot in self._slots.values()
                    if slot.ask and slot.status == EmbeddingState.PENDING]
            asks += [a for slot in self._slots.values() for a in slot.abandoned]
        for rid in requests:
            self.release(rid)
        with self._lock:
            self._retained.clear()
        for call in calls:  # a fetch waiting on a busy encoder would hold the shutdown for its whole wait
            call.cancel()
        self._release_now(asks, _CLOSE_RELEASE_TIMEOUT_S)
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._prefetch_pool.shutdown(wait=True, cancel_futures=False)
        self.ring.close()
        for channel in self._channels.values():
            channel.close()

    def stats(self) -> RemoteSourceStats:
        """A copy of the counters, with the routing ring's size."""
        with self._lock:
            return dataclasses.replace(self._counters, encoders=len(self.ring.members),
                                       embeddings_retained_bytes=self._retained.bytes_held,
                                       embeddings_retained_evictions=self._retained.evictions,
                                       embedding_transports=dict(self._counters.embedding_transports))

    # -- the worker side ------------------------------------------------------------------------
    def _fetch(self, key: tuple[str, str], req: EmbeddingRequest) -> None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or slot.started:  # released before it ran, or taken up by a demand fetch
                return
            slot.started = True
            deadline = slot.deadline
        try:
            self._fetch_on_ring(key, req, deadline)
        finally:  # answers lost on a broken link: their leases go back whatever the image's fate
            self._release_abandoned(self._take_abandoned(key))

    def _fetch_on_ring(self, key: tuple[str, str], req: EmbeddingRequest, deadline: float) -> None:
        encoder = ""
        try:
            encoder = self._route(key, req, deadline)
            while True:
                try:
                    ref, tensor = self._fetch_owned(encoder, req, deadline)
                    break
                except EncoderLeftRing as moved:  # its replica went away: ask the image's new owner
                    log.info("encoder %s left the ring; %s goes to %s", encoder, req.content_hash[:16],
                             moved.owner)
                    encoder = moved.owner
                    with self._lock:
                        if key in self._slots:
                            self._slots[key].encoder = encoder
        except grpc.RpcError as exc:
            # Clients see the encoder's own message for its refusals; transport errors name addresses
            # and stay in the log.
            log.warning("encoder %s: %s: %s", encoder, exc.code().name, exc.details())
            detail = f": {exc.details()}" if exc.code() not in TRANSPORT_CODES else ""
            # The encoder refusing *our* credentials is the server's fault, not the client's token.
            code = grpc.StatusCode.INTERNAL if exc.code() == grpc.StatusCode.UNAUTHENTICATED else exc.code()
            self._fail(key, code, f"encoder: {exc.code().name}{detail}")
            return
        except (EncoderUnavailableError, LeaseLapsedError) as exc:
            self._fail(key, grpc.StatusCode.UNAVAILABLE, str(exc))
            return
        except EncoderBusyError as exc:
            self._fail(key, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            return
        except Released:  # its request ended: nothing to deliver, nothing failed
            return
        except Exception as exc:  # noqa: BLE001 - a broken ref fails this image, never the engine
            log.exception("importing embedding %s failed", req.content_hash[:16])
            self._fail(key, grpc.StatusCode.INTERNAL, f"cannot read embedding: {type(exc).__name__}: {exc}")
            return
        transport = ref.WhichOneof("location") or "none"
        with self._lock:
            slot = self._slots.get(key)
            stale = slot is None or slot.released
            if not stale:
                slot.tensor, slot.cache_hit = tensor, ref.cache_hit
                slot.transport, slot.status = transport, EmbeddingState.READY
                self._counters.embeddings_from_encoder_cache += int(ref.cache_hit)
                transports = self._counters.embedding_transports
                transports[transport] = transports.get(transport, 0) + 1
        if not stale:
            self.notify_change()

    def _fetch_owned(self, encoder: str, req: EmbeddingRequest, deadline: float,
                     busy_until: float | None = None) -> tuple[common_pb2.EmbeddingRef, torch.Tensor]:
        """The embedding, copied out of the encoder's arena while its lease provably held, and the
        lease given back at once.

        A view kept until prefill could be read after its lease lapsed, when the encoder may already
        have written another image (another tenant's) into the slice. The copy (a few microseconds
        on a GPU) is taken right away, and it counts only if it finished before the lease could have
        expired: the encoder counts the lease's time from the Encode's arrival (no earlier than the moment
        we sent it), however long the Encode took. Otherwise the image is asked for again, once, with a
        reach deadline of its own (the first ask's may have passed while a busy encoder worked on it),
        bounded by the image's busy deadline.
        """
        busy_until = self.retry.busy_deadline(deadline) if busy_until is None else busy_until
        for attempt in range(2):
            if attempt:
                deadline = self.retry.renewed_deadline(time.monotonic(), busy_until)
                if deadline <= time.monotonic():  # says nothing of the encoder's reach: it answered
                    raise EncoderBusyError(self.retry.out_of_time_message())
            sent_at = time.monotonic()
            ref = self._encode(encoder, req, self.accept_for(encoder), deadline, busy_until)
            if not can_import(ref):  # e.g. an SHM segment on another host: NIXL or the bytes instead
                self._transports.note_unreadable(encoder, ref)
                self._release_leases(encoder, [ref.lease_id] if ref.lease_id else [])
                sent_at = time.monotonic()
                ref = self._encode(encoder, req, self._transports.across_hosts(ref), deadline, busy_until)
            if not ref.lease_id:  # inline bytes: ours already
                return ref, import_embedding(ref, device=self.device, source=encoder)
            with self._lock:
                self._counters.active_leases += 1  # held only for the copy
            tensor = None
            try:
                tensor = self._copy_out(ref, encoder)
            except NixlTransferError as exc:  # the lease goes back below; the bytes come by gRPC
                log.warning("embedding %s: %s; asking for its bytes", req.content_hash[:16], exc)
            finally:
                self._release_leases(encoder, [ref.lease_id])
                with self._lock:
                    self._counters.active_leases -= 1
            if tensor is None:
                ref = self._encode(encoder, req, [common_pb2.TRANSPORT_INLINE], deadline, busy_until)
                return ref, import_embedding(ref, device=self.device, source=encoder)
            if lease_held_through(sent_at, ref.lease_expires_in_s, time.monotonic()):
                return ref, tensor
            log.warning("embedding %s: copy finished after its lease could have lapsed (attempt %d)",
                        req.content_hash[:16], attempt + 1)
        raise LeaseLapsedError("embedding lease lapsed before it could be read; the encoder is overloaded")

    @property
    def accept(self) -> list[int]:
        """The transports this process can read, best first."""
        return self._transports.accept

    def accept_for(self, encoder: str) -> list[int]:
        """The transports to ask `encoder` for, best first (transport_choice.py)."""
        return self._transports.accept_for(encoder)

    def _route(self, key: tuple[str, str], req: EmbeddingRequest, deadline: float) -> str:
        """The image's encoder by the ring; while no encoder is serving, wait for one until deadline."""
        while True:
            try:
                encoder = self.ring.route(req.content_hash)
                break
            except NoEncoderError as exc:
                if self._closed or time.monotonic() + self.retry.initial_backoff_s > deadline:
                    raise EncoderUnavailableError(str(exc)) from None
                time.sleep(self.retry.initial_backoff_s)
        with self._lock:
            if key in self._slots:
                self._slots[key].encoder = encoder
        return encoder

    def _stub(self, encoder: str) -> encoder_pb2_grpc.EncoderServiceStub:
        with self._lock:
            stub = self._stubs.get(encoder)
            if stub is None:
                channel = open_channel(encoder, self._tls, self._channel_options)
                self._channels[encoder] = channel
                stub = self._stubs[encoder] = encoder_pb2_grpc.EncoderServiceStub(channel)
            return stub

    def _copy_out(self, ref: common_pb2.EmbeddingRef, encoder: str) -> torch.Tensor:
        """A tensor of our own with the ref's rows, complete when this returns."""
        # Keyed by encoder: a restarted encoder's new arena supersedes (and unmaps) its old one.
        if self.device.type != "cuda":
            tensor = import_embedding(ref, device=self.device, source=encoder)
            return tensor if ref.WhichOneof("location") == "nixl" else tensor.clone()  # NIXL's is ours
        copier = self._copiers.get(threading.get_ident())
        if copier is None:
            copier = self._copiers.setdefault(threading.get_ident(), SideStreamCopier(self.device))
        return copier.copy(ref, encoder)

    def _encode(self, encoder: str, req: EmbeddingRequest, accept: list[int], deadline: float,
                busy_until: float | None = None) -> common_pb2.EmbeddingRef:
        """Encode by hash, then with bytes on NOT_FOUND, retrying while the encoder is unreachable, all
        by one deadline. For a file the front end sent ahead, the encoder waits (briefly) for the file to
        arrive: the ask may overtake it."""
        video = req.video
        try:
            return self._call_encode(encoder, req, by_hash(req), accept, deadline,
                                     await_file_ms=_SENT_AHEAD_WAIT_MS if req.sent_ahead else 0,
                                     busy_until=busy_until)
        except grpc.RpcError as exc:
            has_bytes = req.image is not None or (video is not None and video.data is not None)
            if exc.code() != grpc.StatusCode.NOT_FOUND or not has_bytes:
                raise
        with self._lock:
            self._counters.images_resent += 1
        item = with_bytes(req, max(deadline - time.monotonic(), 0.0))
        return self._call_encode(encoder, req, item, accept, deadline, busy_until=busy_until)

    def _call_encode(self, encoder: str, req: EmbeddingRequest, item: EncodeItem, accept: list[int],
                     deadline: float, await_file_ms: int = 0,
                     busy_until: float | None = None) -> common_pb2.EmbeddingRef:
        """One input's Encode, retried while the encoder is unreachable until `deadline` (its reach); a
        busy encoder is waited for until `busy_until` (busy_timeout_s from the image's first ask)."""
        key = (req.request_id, req.content_hash)
        request = encoder_pb2.EncodeRequest(request_id=req.request_id, accept=accept,
                                            cache_salt=req.cache_salt, prefetch=req.prefetch,
                                            lease_owner=self._lease_owner, await_file_ms=await_file_ms)
        item.add_to(request)
        if common_pb2.TRANSPORT_NIXL in accept:  # its agent's metadata comes once, not with every ref
            request.nixl_agent = known_agent(encoder)
        policy = self.retry
        busy_until = policy.busy_deadline(deadline) if busy_until is None else busy_until
        backoff = policy.initial_backoff_s
        attempts, full_since = 0, None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EncoderUnavailableError(f"encoder unreachable within {policy.total_timeout_s:.0f} s "
                                              f"({attempts} attempts)")
            attempts += 1
            with self._lock:
                slot = self._slots.get(key)
                request.request_id = slot.next_ask() if slot is not None else f"{req.request_id}.{attempts}"
            try:
                answer = self._await_encode(encoder, req, request, deadline, busy_until).embeddings[0]
            except EncoderBusyError:  # cancelled as it may have been answered
                self._abandon(key, encoder, request.request_id)
                raise
            except grpc.RpcError as exc:
                if exc.code() in TRANSPORT_CODES:  # its answer, if any, may have been lost on the way
                    self._abandon(key, encoder, request.request_id)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not isinstance(exc, Unresponsive):
                    raise EncoderBusyError(self.retry.busy_message()) from None  # the call's own timeout
                if exc.code() not in RETRYABLE or self._closed:
                    raise
                owner = self._owner_now(req.content_hash)
                if owner is not None and owner != encoder:
                    raise EncoderLeftRing(owner) from None
                # Full jitter: callers turned away together (a full cache refuses every image but the
                # one it admits) must not all come back together, or each wave admits one again.
                pause = random.uniform(0.0, backoff)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Busy, not down: the encoder answered, refusing for now; RESOURCE_EXHAUSTED says so
                    # (retriable later, 429 at the gateway), whichever bound ends the waiting.
                    full_since = full_since or time.monotonic()
                    if (time.monotonic() + pause - full_since > policy.full_cache_wait_s
                            or time.monotonic() + pause > deadline):
                        raise
                if time.monotonic() + pause > deadline:
                    raise EncoderUnavailableError(
                        f"encoder unreachable after {attempts} attempts over {policy.total_timeout_s:.0f} s "
                        f"({exc.code().name})") from None
                log.warning("encoder %s: %s, retrying in %.2f s", encoder, exc.code().name, pause)
                time.sleep(pause)
                backoff = min(policy.max_backoff_s, backoff * 2)
                continue
            # It answers again: the leases of its answers lost on the way are named by now; give them back.
            self._release_abandoned(self._take_abandoned(key, encoder))
            return answer

    def _await_encode(self, encoder: str, req: EmbeddingRequest, request: encoder_pb2.EncodeRequest,
                      deadline: float, busy_until: float) -> encoder_pb2.EncodeResponse:
        """One Encode, kept open while the encoder shows it is alive (see the module docstring).

        Raises the call's RpcError, Unresponsive (UNAVAILABLE) when neither the call nor a stats call
        is answered by `deadline` (or within an attempt), EncoderBusyError past busy_until."""
        call = self._stub(encoder).Encode.future(
            request, timeout=max(busy_until - time.monotonic(), 0.001), wait_for_ready=False,
            metadata=auth_metadata(self._token, tenant_of_salt(req.cache_salt)))
        key = (req.request_id, req.content_hash)
        if not self._track(call, key):  # released meanwhile: a hit may have been answered already
            self._release_asks(encoder, [request.request_id])
        limit = deadline  # until the encoder shows it is alive, an unreachable one's bound applies
        try:
            while True:
                wait = max(min(self.retry.attempt_timeout_s, limit - time.monotonic()), 0.0)
                if wait <= 0 and not call.done():  # an answer already here is taken, however late
                    if limit == busy_until:
                        raise EncoderBusyError(self.retry.busy_message())
                    raise Unresponsive()
                try:
                    return call.result(timeout=wait)
                except grpc.FutureTimeoutError:
                    pass
                except grpc.FutureCancelledError:  # close() or release() cancelled it
                    if self._closed:
                        raise EncoderUnavailableError("the decoder is shutting down") from None
                    raise Released() from None
                if not self._answers(encoder):
                    raise Unresponsive()
                limit = busy_until
                with self._lock:
                    self._counters.encoder_busy_waits += 1
        finally:
            call.cancel()  # a no-op once it has finished; otherwise the encoder may drop the work
            self._untrack(call, key)

    def _track(self, call: grpc.Future, key: tuple[str, str] | None = None) -> bool:
        """Count call among the Encodes that close() cancels, and as key's that release() cancels; it is
        cancelled at once when the source is closed or key released already (then False)."""
        with self._lock:
            slot = self._slots.get(key) if key is not None else None
            if self._closed or (key is not None and (slot is None or slot.released)):
                call.cancel()
                return False
            self._open_calls.add(call)
            if slot is not None:
                slot.call = call
            return True

    def _untrack(self, call: grpc.Future, key: tuple[str, str] | None = None) -> None:
        with self._lock:
            self._open_calls.discard(call)
            slot = self._slots.get(key) if key is not None else None
            if slot is not None and slot.call is call:
                slot.call = None

    def _answers(self, encoder: str) -> bool:
        """Whether the encoder answers a stats call (any answer but a transport failure counts)."""
        try:
            self._stub(encoder).GetStats(common_pb2.StatsRequest(),
                                         timeout=min(PROBE_TIMEOUT_S, self.retry.attempt_timeout_s),
                                         metadata=auth_metadata(self._token))
        except grpc.RpcError as exc:
            return exc.code() not in TRANSPORT_CODES
        return True

    def _boost(self, encoder: str, req: EmbeddingRequest) -> grpc.Future:
        """A demand Encode by hash for an image whose lookahead Encode is still queued at the encoder:
        it joins that production and raises it to demand priority. Its answer (a lease on the same
        entry, once ready) is given back at once; the lookahead fetch delivers the rows. Best effort:
        an image the encoder has not seen yet (NOT_FOUND) or any failure changes nothing. Sent from the
        asking thread with nothing waiting on it: the answer comes only once the image is encoded, and a
        fetch worker held that long would keep images needed now queued behind it. Returns the call."""
        request = encoder_pb2.EncodeRequest(
            request_id=req.request_id, accept=self.accept_for(encoder), cache_salt=req.cache_salt,
            prefetch=False, lease_owner=self._lease_owner)
        by_hash(req).add_to(request)
        call = self._stub(encoder).Encode.future(request, timeout=self.retry.attempt_timeout_s,
                                                 metadata=auth_metadata(self._token,
                                                                        tenant_of_salt(req.cache_salt)))
        self._track(call)

        def answered(done: grpc.Future) -> None:
            self._untrack(done)
            if done.cancelled():  # close() cancelled it
                return
            error = done.exception()
            if error is not None:
                log.debug("boost of %s: %s", req.content_hash[:16], getattr(error, "code", lambda: error)())
                return
            with self._lock:
                self._counters.lookahead_boosted += 1  # it reached the encoder
            self._release_leases(encoder, [ref.lease_id for ref in done.result().embeddings if ref.lease_id])

        call.add_done_callback(answered)
        return call

    def _owner_now(self, content_hash: str) -> str | None:
        try:
            return self.ring.route(content_hash)
        except NoEncoderError:
            return None

    def _release_leases(self, encoder: str, lease_ids: list[str], asks: Sequence[str] = ()) -> None:
        """Give leases back (by id, and those named after asks) without waiting for the answer: the image
        is ready as soon as its rows are copied, not one more round trip later."""
        if not lease_ids and not asks:
            return
        call = self._stub(encoder).Release.future(encoder_pb2.ReleaseRequest(
            lease_ids=lease_ids, request_ids=list(asks), lease_owner=self._lease_owner), timeout=5.0,
            metadata=auth_metadata(self._token))

        def _log_failure(done: grpc.Future) -> None:
            if done.cancelled() or done.exception() is None:
                return
            # The lease expires by its TTL on the encoder anyway.
            log.warning("release of %d leases (%d asks) on %s failed: %s", len(lease_ids), len(asks), encoder,
                        done.code().name)

        call.add_done_callback(_log_failure)

    def _take_abandoned(self, key: tuple[str, str], encoder: str | None = None) -> list[tuple[str, str]]:
        """The key's abandoned asks (of `encoder`, or all), forgotten by the slot."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return []
            taken = [a for a in slot.abandoned if encoder is None or a[0] == encoder]
            slot.abandoned = [a for a in slot.abandoned if a not in taken]
            return taken

    def _abandon(self, key: tuple[str, str], encoder: str, ask: str) -> None:
        """An Encode failed on the link: the encoder may have answered it with a lease that was lost on the
        way. Its ask is released by name once the encoder answers again (then the encoder has named that
        answer's leases, if any) or when the image's fetch ends; at once if the image is gone already."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and not slot.released:
                slot.abandoned.append((encoder, ask))
                return
        self._release_abandoned([(encoder, ask)])

    def _release_abandoned(self, abandoned: Sequence[tuple[str, str]]) -> None:
        by_encoder: dict[str, list[str]] = {}
        for encoder, ask in abandoned:
            by_encoder.setdefault(encoder, []).append(ask)
        for encoder, asks in by_encoder.items():
            self._release_asks(encoder, asks)

    def _release_now(self, asks: Sequence[tuple[str, str]], timeout_s: float) -> None:
        """Give back the leases of these (encoder, ask)s and wait up to timeout_s for the answers: at
        close, when the channels are about to go."""
        by_encoder: dict[str, list[str]] = {}
        for encoder, ask in asks:
            if encoder:
                by_encoder.setdefault(encoder, []).append(ask)
        calls = [self._stub(encoder).Release.future(encoder_pb2.ReleaseRequest(
            request_ids=names, lease_owner=self._lease_owner), timeout=timeout_s,
            metadata=auth_metadata(self._token)) for encoder, names in by_encoder.items()]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError as exc:  # the encoder's TTL collects them
                log.info("release of asks at close: %s", exc.code().name)

    def _release_asks(self, encoder: str, asks: list[str]) -> None:
        """Give back, without waiting, every lease the encoder answered these asks (Encode request_ids)
        with: answers cancelled as they came, never read here."""
        if encoder and not self._closed:
            self._release_leases(encoder, [], asks)

    def _fail(self, key: tuple[str, str], code: grpc.StatusCode, message: str) -> None:
        if code in STAGE_CODES:  # named, so that a client learns which stage was slow or unreachable
            message = f"{ENCODER_STAGE}: {message}"
        with self._lock:
            slot = self._slots.get(key)
            self._counters.embedding_failures += 1
            failed = slot is not None and not slot.released
            if failed:
                slot.status, slot.code, slot.error = EmbeddingState.FAILED, code, message
                self._failed_requests[key[0]] = code
        if failed:
            self.notify_change()
