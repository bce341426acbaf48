"""Decoders behind the gateway: least-outstanding-requests balancing, health tracking, and one
Generate call as an object that can be cancelled.

A decoder that answers UNAVAILABLE before sending anything (down, or draining on SIGTERM) is skipped
for another one; once tokens have flowed, an error ends the call (gateway/decoder_retry.py starts a
request again elsewhere when nothing of it had reached the client). The decoders are the --decoder
targets (discovery.py): with dns:/// or file: ones the pool looks again every health round, adds the
decoders that appear and retires those that are gone (their channel closes once their calls end).
The n choices of one OpenAI request (`n` > 1) are a GenerationGroup on one decoder, so that they share
the prompt's KV there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.client import CHANNEL_OPTIONS
from common.pb import decoder_pb2, decoder_pb2_grpc
from common.security.client_auth import token_interceptors
from common.security.options import ClientSecurity
from common.security.tls import open_aio_channel
from gateway.discovery import DecoderTargets
from gateway.routing import CacheAwareRouter, RouteKeys, route_keys

log = logging.getLogger("mmserve.gateway")
_HASH_ON_LOOP_BYTES = 1 << 20  # larger requests get their routing keys in a worker thread


@dataclass
class DecoderEndpoint:
    """One decoder: its channel, how many requests the gateway has open on it, its last health."""

    address: str
    channel: grpc.aio.Channel | None = None  # opened by DecoderPool.start, inside the serving event loop
    stub: decoder_pb2_grpc.DecoderServiceStub | None = None
    outstanding: int = 0
    status: str = "UNKNOWN"  # the health service's answer: SERVING, NOT_SERVING, UNREACHABLE, ...

    @property
    def usable(self) -> bool:
        return self.status in ("SERVING", "UNKNOWN")


@dataclass
class DecoderPool:
    """Decoders balanced by least outstanding requests (ties taken in turn), or, with a router, by where
    each request's prefix and images probably are cached, within a load slack (routing.py)."""

    endpoints: list[DecoderEndpoint]
    health_interval_s: float = 2.0
    security: ClientSecurity = field(default_factory=ClientSecurity)  # TLS and token towards the decoders
    targets: DecoderTargets | None = None  # where the endpoints come from; None: fixed endpoints
    router: CacheAwareRouter | None = None  # None: least outstanding requests
    on_failover: Callable[[], None] | None = None  # counts each call moved to another decoder on UNAVAILABLE
    _turn: itertools.count = field(default_factory=itertools.count)
    _health_task: asyncio.Task | None = None
    _retired: list[DecoderEndpoint] = field(default_factory=list)  # gone, calls still open
    _started: bool = False

    @classmethod
    def of(cls, specs: Sequence[str], health_interval_s: float = 2.0,
           security: ClientSecurity | None = None, routing: str = "least-outstanding") -> DecoderPool:
        """A pool over --decoder specs (addresses, dns:///NAME:PORT, file:PATH), connecting with
        security (plaintext without a token by default), routing by `routing` (ROUTING_POLICIES)."""
        targets = DecoderTargets(list(specs))
        router = CacheAwareRouter() if routing == "cache-aware" else None
        return cls([DecoderEndpoint(a) for a in targets.addresses()], health_interval_s,
                   security or ClientSecurity(), targets=targets, router=router)

    def refresh(self, now: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
        """Look at the targets again (or take `now`, what they name, looked up by the caller): (addresses
        added, addresses retired). A retired decoder gets no new calls; its channel closes once its open
        calls have ended."""
        self._close_idle_retired()
        if self.targets is None or not self.targets.dynamic:
            return [], []
        now = self.targets.addresses() if now is None else now
        known = {e.address: e for e in self.endpoints}
        added = [DecoderEndpoint(a) for a in now if a not in known]
        gone = [e for e in self.endpoints if e.address not in now]
        for endpoint in added:
            if self._started:
                self._open(endpoint)
        self.endpoints = [e for e in self.endpoints if e.address in now] + added
        self._retired.extend(gone)
        if self.router is not None:
            for endpoint in gone:
                self.router.forget(endpoint.address)
        if added or gone:
            log.info("decoders: +%s -%s -> %d", [e.address for e in added], [e.address for e in gone],
                     len(self.endpoints))
        self._close_idle_retired()
        return [e.address for e in added], [e.address for e in gone]

    def _close_idle_retired(self) -> None:
        for endpoint in [e for e in self._retired if e.outstanding == 0]:
            self._retired.remove(endpoint)
            if endpoint.channel is not None:
                asyncio.get_running_loop().create_task(endpoint.channel.close())

    def _open(self, endpoint: DecoderEndpoint) -> None:
        endpoint.channel = open_aio_channel(endpoint.address, self.security.tls, CHANNEL_OPTIONS,
                                            token_interceptors(self.security.token, aio=True))
        endpoint.stub = decoder_pb2_grpc.DecoderServiceStub(endpoint.channel)

    def pick(self, exclude: Sequence[DecoderEndpoint] = (), keys: RouteKeys | None = None
             ) -> DecoderEndpoint | None:
        """The usable decoder with the fewest outstanding requests, or the router's choice for keys
        (None when none is left to try)."""
        candidates = [e for e in self.endpoints if e not in exclude]
        usable = [e for e in candidates if e.usable] or candidates  # all look down: try anyway
        if not usable:
            return None
        turn = next(self._turn)
        n = len(usable)
        rotated = [usable[(turn + i) % n] for i in range(n)]
        if self.router is not None and keys is not None:
            return self.router.choose(rotated, keys)
        return min(rotated, key=lambda e: e.outstanding)

    async def check_health(self) -> dict[str, str]:
        """Ask every decoder's health service once; returns {address: status}."""
        async def one(endpoint: DecoderEndpoint) -> None:
            try:
                reply = await health_pb2_grpc.HealthStub(endpoint.channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2.0)
                endpoint.status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError:
                endpoint.status = "UNREACHABLE"

        await asyncio.gather(*(one(e) for e in self.endpoints))
        return {e.address: e.status for e in self.endpoints}

    async def _health_loop(self) -> None:
        while True:
            try:
                if self.targets is not None and self.targets.dynamic:  # DNS and files off the loop
                    self.refresh(await asyncio.to_thread(self.targets.addresses))
                else:
                    self._close_idle_retired()
                await self.check_health()
            except Exception:  # never let the loop die: a failed round leaves the old answers
                log.exception("decoder health check failed")
            await asyncio.sleep(self.health_interval_s)

    def start(self) -> None:
        """Open the channels and start health checks (grpc.aio channels belong to the running loop)."""
        for endpoint in self.endpoints:
            self._open(endpoint)
        self._started = True
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await asyncio.gather(*(e.channel.close() for e in [*self.endpoints, *self._retired]
                               if e.channel is not None), return_exceptions=True)

    async def generate(self, request: decoder_pb2.GenerateRequest, timeout: float | None,
                       user: str = "", tried: list[DecoderEndpoint] | None = None) -> Generation:
        """Start a Generate call and wait for its first message, so that errors the decoder finds in the
        request (or a decoder that is down) surface before any HTTP response has started. `user` (the
        OpenAI field) keeps a session on one decoder when the cache-aware router has no better clue.
        `tried`: decoders not to send it to; each decoder it is sent to is appended."""
        tried = [] if tried is None else tried
        keys = None
        if self.router is not None:  # hashing megabytes of media would hold up the event loop
            big = request.ByteSize() > _HASH_ON_LOOP_BYTES
            keys = await asyncio.to_thread(route_keys, request, user) if big else route_keys(request, user)
        while True:
            endpoint = self.pick(exclude=tried, keys=keys)
            if endpoint is None:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details="no decoder available")
            tried.append(endpoint)
            generation = Generation(endpoint, endpoint.stub.Generate(request, timeout=timeout),
                                    request.request_id)
            if self.router is not None:
                self.router.sent(endpoint.address, keys)
            try:
                await generation.start()
                return generation
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or all(e in tried for e in self.endpoints):
                    raise
                log.warning("decoder %s unavailable (%s); trying another", endpoint.address, exc.details())
                endpoint.status = "UNREACHABLE"
                if self.on_failover is not None:
                    self.on_failover()

    async def generate_group(self, requests: Sequence[decoder_pb2.GenerateRequest], timeout: float | None,
                             request_id: str, user: str = "", tried: list[DecoderEndpoint] | None = None
                             ) -> GenerationGroup:
        """Start the calls of one request's choices, all on one decoder (not one in `tried`; see
        generate). The first is started alone and its first token awaited (its prefill done, the prompt's
        full KV blocks in the decoder's prefix cache); the others start then, so their prefills hit those
        blocks instead of all computing the prompt at once. Any failure cancels the calls already open."""
        first = await self.generate(requests[0], timeout, user, tried)
        endpoint, started = first.endpoint, [first]
        try:
            rest = [Generation(endpoint, endpoint.stub.Generate(r, timeout=timeout), r.request_id)
                    for r in requests[1:]]
            started += rest
            await asyncio.gather(*(g.start() for g in rest))
        except BaseException:
            for generation in started:
                generation.cancel()
            raise
        return GenerationGroup(request_id, started)


class Generation:
    """One Generate call on one decoder; counts as outstanding there until it ends or is cancelled."""

    def __init__(self, endpoint: DecoderEndpoint, call: grpc.aio.UnaryStreamCall,
                 request_id: str = "") -> None:
        self.endpoint = endpoint
        self.request_id = request_id
        self.call = call
        self.first: decoder_pb2.GenerateResponse | None = None
        self.ended = False
        endpoint.outstanding += 1

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.endpoint.outstanding -= 1

    async def start(self) -> None:
        try:
            first = await self.call.read()
        except BaseException:
            self.cancel()
            raise
        if first is grpc.aio.EOF:  # the decoder always sends a last message; this is a broken stream
            self._end()
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="the decoder ended the stream without a message")
        self.first = first

    async def __aiter__(self) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        try:
            if self.first is not None:
                yield self.first
            while True:
                chunk = await self.call.read()
                if chunk is grpc.aio.EOF:
                    break
                yield chunk  # read on to EOF after the last message: the call then ends with OK
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancel the call if it is still open (the decoder then frees its KV blocks and leases)."""
        if not self.call.done():
            self.call.cancel()
        self._end()


@dataclass
class GenerationGroup:
    """The Generate calls of one OpenAI request's choices; iterating gives (choice index, message) in
    the order the messages arrive, each call's messages in order."""

    request_id: str
    members: list[Generation]
    on_end: Callable[[], None] | None = None  # called once, at the first cancel(): the request has ended

    def cancel(self) -> None:
        """Cancel every call still open (each response path calls this when it ends)."""
        for generation in self.members:
            generation.cancel()
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()

    async def __aiter__(self) -> AsyncIterator[tuple[int, decoder_pb2.GenerateResponse]]:
        if len(self.members) == 1:  # the usual case: no tasks, no queue
            async for chunk in self.members[0]:
                yield 0, chunk
            return
        queue: asyncio.Queue = asyncio.Queue()  # (index, message, error); message None: that call ended

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for chunk in generation:
                    queue.put_nowait((index, chunk, None))
                queue.put_nowait((index, None, None))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((index, None, exc))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.members)]
        try:
            open_calls = len(tasks)
            while open_calls:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    open_calls -= 1
                else:
                    yield index, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.cancel()
