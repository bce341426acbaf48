"""Content-addressed embedding cache over an arena: byte budget, LRU, leases, in-flight dedup.

States of a key: absent -> pending (one producer runs the vision tower, others join) -> ready.
A ready entry with no lease sits in the LRU `freeable` list and is evicted lazily, only when an
insert needs its bytes. Leased entries are pinned; each lease expires after a TTL so a reader that
crashed cannot pin memory forever. When the bytes an insert needs are all leased the insert fails
with CacheFullError (never waits: a decoder holding leases while waiting for the encoder would
deadlock). An item larger than the whole arena is refused with ItemTooLargeError.

An entry (an image's or a video's) is one tensor of any shape in one contiguous slice: [rows, hidden] for
LLaVA and Qwen2.5-VL,
[parts, rows, hidden] for Qwen3-VL (the merged features and each DeepStack level), so every part of an
image is cached, leased, evicted and handed over together, and its bytes count once against the budget.

On CUDA every entry carries its producer event (interprocess), recorded after the write on the
producer's stream; readers wait on it instead of the producer synchronising. A slice freed by
eviction is only rewritten after the new writer's stream waits on the evicted entry's event.

Tenant isolation:

- Salt scope. Every entry (and every production in flight) remembers the cache_salt it was made under.
  A key resolves only for a caller passing that same salt; for any other salt the entry behaves
  exactly as if it were absent (no hit, no join, `contains` is False, no counter moves). Keys of images
  sent as bytes already cover the salt (common/hashing.py), so this matters for hash-only access:
  someone who learned another tenant's content hash cannot read its embedding or probe its presence.
- Lease ownership. Every lease is bound to the owner string it was taken with; `release` frees only
  leases whose owner equals the caller's, and counts nothing else, so a foreign lease id answers like
  an unknown one. The empty owner is an anonymous owner of its own: leases taken with "" are freed
  only by a release with "", and a release with "" never frees an owned lease. TTL expiry frees every
  lease whatever its owner.

Thread-safe: the server's event loop and the vision worker thread both call in.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from common.errors import CapacityError, InvalidInputError, UnavailableError
from common.transport.arena import Arena, SliceAllocator
from common.video.rules import VideoTiming
from encoder_svc.defaults import DEFAULT_LEASE_TTL_S, DEFAULT_SENT_AHEAD_CLAIM_S


class CacheFullError(CapacityError):
    """Every byte the item needs is leased: the caller gets RESOURCE_EXHAUSTED."""


class ItemTooLargeError(CacheFullError):
    """The item is larger than the whole cache."""


class SaltClashError(RuntimeError):
    """A producer's key names an entry made under another salt: a content-hash collision."""


class EntryKindError(InvalidInputError):
    """A content hash names an entry of the other kind: a video's given for an image, or the reverse."""


class ProductionAbandoned(Exception):  # noqa: N818 - not an error: nobody is left to tell
    """Every caller of a production has gone (still_wanted answered False): its producer stops."""


class ShuttingDownError(UnavailableError):
    """The encoder is stopping: the caller gets UNAVAILABLE and may retry elsewhere."""


@dataclass
class Entry:
    """A ready embedding: a slice of the arena plus what a reader needs to view it."""

    key: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]  # [rows, hidden], or [parts, rows, hidden] for a multi-part embedding
    dtype: torch.dtype
    event: object | None = None  # torch.cuda.Event(interprocess=True) on GPU
    event_handle: bytes = b""
    leases: int = 0
    salt: str = ""  # the cache_salt it was made under: only that salt may reach it
    grid: tuple[int, ...] = ()  # the image's (t, h, w) patch grid (Qwen-VL); () for fixed-size models
    timing: VideoTiming | None = None  # a video's group timestamps and seconds per group; None: an image
    # Produced ahead for a request that asks for it next (a decoder's file sent ahead): that first ask is
    # the one the tower ran for, so it is answered as a miss, not a hit, if it comes before this clock
    # time (a lease's TTL after production: a later ask is not the one, which may never come). 0: none.
    awaiting_ask_until: float = 0.0


@dataclass
class Handle:
    """One request's grip on an entry: a lease unless it asked for none."""

    entry: Entry
    lease_id: str = ""
    lease_expires_in_s: float = 0.0
    hit: bool = False
    expires_at: float = 0.0  # the lease's end on the cache's clock (EmbeddingCache.now); 0: no lease


@dataclass
class _Waiter:
    future: cf.Future
    want_lease: bool
    owner: str = ""
    # A file sent ahead stands in for its request's ask until that ask joins (then it steps aside) or
    # until this time on the cache's clock (then it is gone): 0 for every other waiter.
    claim_by: float = 0.0


@dataclass
class _Pending:
    salt: str
    video: bool = False
    waiters: list[_Waiter] = field(default_factory=list)
    for_ask: bool = False  # see Entry.awaiting_ask_until


@dataclass
class _Lease:
    key: str
    expires_at: float
    owner: str = ""
    ask: str = ""  # the request_id of the Encode it answered (name_leases), for release_asks


@dataclass
class CacheStats:
    """Counters and gauges of the cache (a snapshot)."""

    bytes_used: int
    capacity: int
    entries: int
    hits: int
    misses: int
    evictions: int
    leased_bytes: int
    active_leases: int
    expired_leases: int
    inflight_dedups: int


class EmbeddingCache:
    """Embeddings keyed by content hash, stored in `arena`, bounded by its capacity in bytes."""

    def __init__(self, arena: Arena, lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 sent_ahead_claim_s: float = DEFAULT_SENT_AHEAD_CLAIM_S) -> None:
        self.arena = arena
        self.allocator = SliceAllocator(arena.capacity)
        self.capacity = self.allocator.capacity
        self.lease_ttl_s = lease_ttl_s
        self.sent_ahead_claim_s = sent_ahead_claim_s
        self._clock = clock
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._freeable: OrderedDict[str, None] = OrderedDict()  # unleased ready entries, LRU first
        self._pending: dict[str, _Pending] = {}
        self._leases: dict[str, _Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, lease_id)
        self._leased_bytes = 0
        self._reserved_inflight = 0  # slices allocated for writes not yet published
        self.hits = self.misses = self.evictions = self.expired_leases = self.inflight_dedups = 0
        self.abandoned = 0  # productions dropped because every waiter had gone (still_wanted)
        self.bytes_made = 0  # embedding bytes of every entry produced (the tower's output, for its cost)

    def now(self) -> float:
        """The cache's clock, which leases expire by."""
        return self._clock()

    # -- reading -----------------------------------------------------------------------------------

    def contains(self, key: str, salt: str = "") -> bool:
        """True when key is ready in the cache under salt (no LRU touch, no lease)."""
        with self._lock:
            return self._visible_locked(key, salt) is not None

    def known(self, key: str, salt: str = "") -> bool:
        """True when key is ready or being produced under salt (what an ask by hash would find)."""
        with self._lock:
            pending = self._pending.get(key)
            producing = pending is not None and pending.salt == salt
            return producing or self._visible_locked(key, salt) is not None

    def peek(self, key: str, salt: str = "") -> Entry | None:
        """key's ready entry under salt, or None (no LRU touch, no lease: read only its metadata)."""
        with self._lock:
            return self._visible_locked(key, salt)

    def _visible_locked(self, key: str, salt: str) -> Entry | None:
        """key's ready entry when it was made under salt; None (as if absent) otherwise."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.salt == salt else None

    def acquire(self, key: str, want_lease: bool = True, expected_nbytes: int | None = None,
                produce: bool = True, salt: str = "", owner: str = "",
                video: bool = False, for_ask: bool = False) -> tuple[cf.Future | None, bool]:
        """Get key's entry under salt: (future of a Handle, must_produce).

        A hit resolves at once. A key already being produced joins that production. Otherwise, with
        produce=True the caller must produce it and call `complete` or `fail`; with produce=False the
        answer is (None, False). `expected_nbytes` lets a miss fail fast (CacheFullError, raised here)
        when the item cannot fit, before any vision work runs.

        An entry or production made under another salt is invisible: with produce=False the answer is
        (None, False) as for an absent key. With produce=True the caller's key was derived from its
        salt, so a clash means two salts hashed to one key (never, short of a hash collision): refused
        with SaltClashError rather than letting one tenant's production replace the other's entry.
        A lease taken here belongs to `owner` (see the module docstring).

        `video` says which kind of input asks: an entry or production of the other kind (a video's hash
        given as an image's, or the reverse) is refused with EntryKindError, never handed out as this one.

        `for_ask`: a production started here is on behalf of a request that asks for the key next (a
        decoder's file sent ahead). That ask is answered as a miss (and counts no hit), whether it comes
        before or after the entry is ready: the tower ran for it, however the two calls raced.

        A file sent ahead (for_ask without a lease) belongs to its request: it waits as that request's
        stand-in, which steps aside when an ask (a caller taking a lease) joins the production, so that
        the production then lives as long as the asks do (a request that ends cancels its ask); a
        stand-in that no ask has relieved within `sent_ahead_claim_s` is gone (its request ended before
        asking, or asks too late to gain from it). One ask relieves one stand-in: files sent ahead by
        two requests keep the production for the second until its own ask comes.
        """
        with self._lock:
            self._sweep_locked()
            entry = self._entries.get(key)
            pending = self._pending.get(key)
            clash = ((entry is not None and entry.salt != salt)
                     or (pending is not None and pending.salt != salt))
            if clash:
                if not produce:
                    return None, False
                raise SaltClashError(f"content hash {key} clashes with an entry of another cache_salt")
            found = (entry.timing is not None) if entry is not None else (
                pending.video if pending is not None else video)
            if found != video:
                raise EntryKindError(f"content hash {key} names {'a video' if found else 'an image'}; "
                                     f"{'a video' if video else 'an image'} input takes only "
                                     f"{'a video' if video else 'an image'}'s hash")
            if entry is not None:
                fut: cf.Future = cf.Future()
                fut.set_result(self._handle_locked(entry, want_lease, hit=self._first_ask_locked(entry),
                                                   owner=owner))
                return fut, False
            fut = cf.Future()
            claim_by = self._clock() + self.sent_ahead_claim_s if for_ask and not want_lease else 0.0
            if pending is not None:
                self.inflight_dedups += 1
                if want_lease:
                    self._relieve_stand_in_locked(pending)
                pending.waiters.append(_Waiter(fut, want_lease, owner, claim_by))
                return fut, False
            if not produce:
                return None, False
            if expected_nbytes is not None:
                self._check_fits_locked(expected_nbytes)
            self.misses += 1
            self._pending[key] = _Pending(salt, video, [_Waiter(fut, want_lease, owner, claim_by)],
                                          for_ask=for_ask)
            return fut, True

    @staticmethod
    def _relieve_stand_in_locked(pending: _Pending) -> None:
        """An ask joined: the oldest live stand-in of a file sent ahead steps aside (see acquire)."""
        for waiter in pending.waiters:
            if waiter.claim_by and not waiter.future.cancelled():
                waiter.future.cancel()
                return

    def _drop_unclaimed_locked(self, pending: _Pending) -> None:
        """Stand-ins of files sent ahead whose ask has not come within their time are gone."""
        now = self._clock()
        for waiter in pending.waiters:
            if waiter.claim_by and waiter.claim_by <= now:
                waiter.future.cancel()

    def lease(self, key: str, salt: str = "", owner: str = "") -> Handle | None:
        """A new lease for owner on a ready entry made under salt (touches LRU), or None when there is
        none (absent, or made under another salt)."""
        with self._lock:
            self._sweep_locked()
            entry = self._visible_locked(key, salt)
            if entry is None:
                return None
            return self._handle_locked(entry, True, hit=self._first_ask_locked(entry), owner=owner)

    def _first_ask_locked(self, entry: Entry) -> bool:
        """Whether an ask that found entry ready is a hit (counted): not when the entry was produced
        ahead for this very ask (Entry.awaiting_ask_until, cleared here)."""
        owed, entry.awaiting_ask_until = self._clock() < entry.awaiting_ask_until, 0.0
        self.hits += int(not owed)
        return not owed

    def read(self, entry: Entry) -> torch.Tensor:
        """A typed view of entry in this process; on CUDA the current stream waits on its event.

        Hold a lease while using the view.
        """
        raw = self.arena.view(entry.offset, entry.nbytes)
        if entry.event is not None:
            entry.event.wait(torch.cuda.current_stream(raw.device))
        return raw.view(entry.dtype).view(entry.shape)

    # -- producing ---------------------------------------------------------------------------------

    def complete(self, key: str, tensor: torch.Tensor) -> None:
        """Store the produced embedding for key and resolve everyone waiting for it.

        On CUDA call this inside the producer's stream context: the write and the event go on it.
        Raises nothing: a failure to store is delivered to the waiters.
        """
        self.complete_many([(key, tensor)])

    def complete_many(self, items: Sequence[tuple[str, torch.Tensor]],
                      grids: Sequence[tuple[int, ...]] | None = None,
                      timings: Sequence[VideoTiming | None] | None = None) -> None:
        """`complete` for a batch: on CUDA one event, recorded after all the batch's writes, fences every
        entry of it (an interprocess event and its handle cost the tower thread more than a write).
        grids: each item's image or video grid, kept with its entry (Qwen-VL); timings: each item's
        video timing (None for an image)."""
        placed: list[tuple[str, torch.Tensor, int, int]] = []  # (key, tensor, offset, nbytes)
        fences: list = []
        keys = [k for k, _ in items]
        grid_of = dict(zip(keys, grids, strict=True)) if grids is not None else {}
        timing_of = dict(zip(keys, timings, strict=True)) if timings is not None else {}
        for key, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            try:
                offset, evicted = self._reserve(nbytes)
            except CacheFullError as exc:
                self.fail(key, exc)
                continue
            placed.append((key, tensor, offset, nbytes))
            fences += evicted
        if not placed:
            return
        try:
            event, handle = self._write([(offset, tensor) for _, tensor, offset, _ in placed], fences)
        except BaseException as exc:
            for key, _, offset, nbytes in placed:
                self.allocator.free(offset)
                with self._lock:
                    self._reserved_inflight -= self.allocator.reserved_size(nbytes)
                self.fail(key, exc)
            raise
        with self._lock:
            for key, tensor, offset, nbytes in placed:
                self._reserved_inflight -= self.allocator.reserved_size(nbytes)
                self._publish_locked(key, offset, nbytes, tensor, event, handle, grid_of.get(key, ()),
                                     timing_of.get(key))

    def _publish_locked(self, key: str, offset: int, nbytes: int, tensor: torch.Tensor, event,
                        handle: bytes, grid: tuple[int, ...] = (), timing: VideoTiming | None = None) -> None:
        pending = self._pending.pop(key, None)
        self.bytes_made += nbytes
        # The producer's salt (from its acquire) goes with the entry; a complete() without an
        # acquire has no salt to give, so its entry is reachable with the empty salt only.
        salt = pending.salt if pending is not None else ""
        # An ask that joined the production while it ran (Encodes lease; Prefetches never do) is told a
        # miss below: nothing is left awaiting.
        awaiting = pending is not None and pending.for_ask and not any(w.want_lease for w in pending.waiters)
        entry = Entry(key, offset, nbytes, tuple(tensor.shape), tensor.dtype, event, handle, salt=salt,
                      grid=tuple(grid), timing=timing,
                      awaiting_ask_until=self._clock() + self.lease_ttl_s if awaiting else 0.0)
        self._entries[key] = entry
        for waiter in pending.waiters if pending is not None else []:
            if waiter.future.cancelled():
                continue
            h = self._handle_locked(entry, waiter.want_lease, hit=False, owner=waiter.owner)
            try:
                waiter.future.set_result(h)
            except cf.InvalidStateError:  # cancelled between the check and here
                self._release_locked(h.lease_id, owner=None)
        if entry.leases == 0:
            self._freeable[key] = None

    def fail(self, key: str, exc: BaseException) -> None:
        """Production of key failed: every waiter gets exc; a later acquire retries."""
        with self._lock:
            pending = self._pending.pop(key, None)
        for waiter in pending.waiters if pending else []:
            if not waiter.future.cancelled():
                try:
                    waiter.future.set_exception(exc)
                except cf.InvalidStateError:
                    pass

    def waiters(self, key: str) -> int:
        """Callers waiting for key's production now (0: nobody, or key is not being produced)."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                return 0
            self._drop_unclaimed_locked(pending)
            return sum(not w.future.cancelled() for w in pending.waiters)

    def still_wanted(self, key: str) -> bool:
        """Whether anyone still waits for key's production (a producer asks between frames or images).

        When every waiter has gone (each one's future cancelled: its RPC was cancelled or timed out), the
        production is dropped here, at once, so a later acquire starts a fresh one instead of joining
        work that is stopping; the answer is False and the producer must stop and call neither
        `complete` nor `fail`. A lookahead Prefetch's waiters are never cancelled: that work is always
        wanted; a file sent ahead waits only as its request's stand-in (see acquire).
        """
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:  # failed or shut down meanwhile
                return False
            self._drop_unclaimed_locked(pending)
            if any(not waiter.future.cancelled() for waiter in pending.waiters):
                return True
            del self._pending[key]
            self.abandoned += 1
            return False

    def _check_fits_locked(self, nbytes: int) -> None:
        size = self.allocator.reserved_size(nbytes)
        if size > self.capacity:
            raise ItemTooLargeError(f"an embedding of {nbytes} bytes is larger than the whole cache "
                                    f"({self.capacity} bytes)")
        if self._leased_bytes + self._reserved_inflight + size > self.capacity:
            raise CacheFullError(f"embedding cache full: {self._leased_bytes} of {self.capacity} bytes "
                                 "are leased; release leases or retry later")

    def _reserve(self, nbytes: int) -> tuple[int, list]:
        """Allocate a slice, evicting LRU unleased entries as needed; returns (offset, fence events)."""
        with self._lock:
            self._sweep_locked()
            self._check_fits_locked(nbytes)
            fences = []
            offset = self.allocator.alloc(nbytes)
            while offset is None:
                if not self._freeable:
                    raise CacheFullError(f"embedding cache full: no unleased entry left to evict for "
                                         f"{nbytes} bytes ({self._leased_bytes} bytes leased)")
                victim_key, _ = self._freeable.popitem(last=False)
                victim = self._entries.pop(victim_key)
                self.allocator.free(victim.offset)
                self.evictions += 1
                if victim.event is not None:
                    fences.append(victim.event)
                offset = self.allocator.alloc(nbytes)
            self._reserved_inflight += self.allocator.reserved_size(nbytes)
            return offset, fences

    def _write(self, writes: list[tuple[int, torch.Tensor]], fences: list) -> tuple[object | None, bytes]:
        """Copy each (offset, tensor) into the arena; on CUDA, after the fences, then one event."""
        if self.arena.device.type != "cuda":
            for offset, tensor in writes:
                self.arena.write(offset, tensor)
            return None, b""
        from common.transport.cuda_ipc import new_producer_event

        stream = torch.cuda.current_stream(self.arena.device)
        for fence in fences:  # an evicted entry's write may still be in flight on another stream
            stream.wait_event(fence)
        for offset, tensor in writes:
            self.arena.write(offset, tensor)
        event = new_producer_event()
        event.record(stream)
        return event, bytes(event.ipc_handle())

    # -- leases ------------------------------------------------------------------------------------

    def _handle_locked(self, entry: Entry, want_lease: bool, hit: bool, owner: str = "") -> Handle:
        if entry.key in self._freeable:
            self._freeable.move_to_end(entry.key)
        if not want_lease:
            return Handle(entry, hit=hit)
        lease_id = uuid.uuid4().hex
        expires = self._clock() + self.lease_ttl_s
        self._leases[lease_id] = _Lease(entry.key, expires, owner)
        heapq.heappush(self._expiry, (expires, lease_id))
        if entry.leases == 0:
            self._freeable.pop(entry.key, None)
            self._leased_bytes += self.allocator.reserved_size(entry.nbytes)
        entry.leases += 1
        return Handle(entry, lease_id, self.lease_ttl_s, hit, expires)

    def _release_locked(self, lease_id: str, owner: str | None) -> bool:
        """Free lease_id if live and owned by owner; owner=None is the cache itself (expiry, a
        cancelled waiter), which may free any lease."""
        lease = self._leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            return False
        del self._leases[lease_id]
        entry = self._entries[lease.key]
        entry.leases -= 1
        if entry.leases == 0:
            self._leased_bytes -= self.allocator.reserved_size(entry.nbytes)
            self._freeable[entry.key] = None  # most recently used: it was just read
        return True

    def release(self, lease_ids: list[str] | tuple[str, ...], owner: str = "") -> int:
        """Release owner's leases; unknown, expired, already released ids and other owners' leases are
        ignored alike (a caller learns nothing about leases that are not its own). Returns how many of
        owner's leases were live and are now freed. The empty owner frees only leases taken with it."""
        with self._lock:
            return sum(self._release_locked(lid, owner) for lid in lease_ids)

    def name_leases(self, lease_ids: Sequence[str], ask: str) -> None:
        """Record that these live leases answered the Encode with request_id `ask` (release_asks)."""
        with self._lock:
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None:
                    lease.ask = ask

    def release_asks(self, asks: Sequence[str], owner: str) -> int:
        """Release owner's leases named (name_leases) after any of `asks`: those of answers its caller
        cancelled and never read, whose ids it never learnt. An ask "R#..." is also released by "R" (a
        decoder names its asks after its request, so a decoder whose engine core is gone can give back
        every lease of the requests it ended without knowing their asks). Nothing for the empty owner:
        request ids, unlike lease ids, can be guessed, and the anonymous owner is anyone's. Returns how
        many."""
        if not owner or not asks:
            return 0
        wanted = set(asks)
        with self._lock:
            named = [lid for lid, lease in self._leases.items()
                     if lease.owner == owner and lease.ask
                     and (lease.ask in wanted or lease.ask.partition("#")[0] in wanted)]
            return sum(self._release_locked(lid, owner) for lid in named)

    def _sweep_locked(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            if self._release_locked(lease_id, owner=None):
                self.expired_leases += 1

    def sweep(self) -> None:
        """Expire leases past their TTL (also done lazily by every other call)."""
        with self._lock:
            self._sweep_locked()

    def stats(self) -> CacheStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            self._sweep_locked()
            used = sum(self.allocator.reserved_size(e.nbytes) for e in self._entries.values())
            return CacheStats(
                bytes_used=used + self._reserved_inflight, capacity=self.capacity,
                entries=len(self._entries), hits=self.hits, misses=self.misses, evictions=self.evictions,
                leased_bytes=self._leased_bytes, active_leases=len(self._leases),
                expired_leases=self.expired_leases, inflight_dedups=self.inflight_dedups)

    def close(self) -> None:
        """Fail pending productions and release the arena."""
        with self._lock:
            keys = list(self._pending)
        for key in keys:
            self.fail(key, ShuttingDownError("encoder shutting down"))
        self.arena.close()
