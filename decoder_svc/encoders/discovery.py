"""Encoder discovery: the set of encoders a decoder routes to, fixed or found by DNS.

`--encoder HOST:PORT` names one encoder. Alone, it is always in the ring; beside other encoders it is
health-checked like a discovered one, so an encoder that was killed or stopped answering leaves the ring
and its images (and the retries of their Encodes) go to the others; while none answers, every fixed
address stays in the ring (an honest UNAVAILABLE beats an empty ring). `--encoder dns:///NAME:PORT`
names every address behind NAME (a Kubernetes headless Service has one A record per ready Pod):

- NAME is resolved at start and again every `interval_s` seconds, on a background thread;
- an address joins the ring once it answers SERVING on the standard health service, and leaves it after
  `eject_after` failed checks in a row (it re-joins after `admit_after` good ones), so a replica that is
  up in DNS but not serving receives no images;
- a lookup that fails (a DNS hiccup) keeps the addresses the name had: losing every encoder because a
  resolver timed out once would re-route every image;
- the ring is consistent: a change moves only the images of the replicas that came or went (see
  routing.py), so only that share is encoded again.

The resolver and the health check are callables, so tests can put several local encoders behind one
name and ask them for real.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.security.tls import ClientTls, open_channel
from decoder_svc.encoders.routing import HashRing

log = logging.getLogger("mmserve.decoder.discovery")

DNS_SCHEME = "dns:"
# (host, port) -> the IP addresses behind host, as strings.
Resolver = Callable[[str, int], Sequence[str]]
# "ip:port" -> True when the encoder there answers SERVING.
HealthCheck = Callable[[str], bool]


class NoEncoderError(RuntimeError):
    """The ring is empty: no configured encoder address is serving right now."""


@dataclass(frozen=True)
class DnsTarget:
    """A `dns:///NAME:PORT` encoder target."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"dns:///{self.host}:{self.port}"


def parse_dns_target(spec: str) -> DnsTarget | None:
    """The DNS target `spec` names, or None when it is a plain HOST:PORT.

    Accepts gRPC's naming syntax `dns:///NAME:PORT`; an authority (`dns://8.8.8.8/NAME:PORT`, a chosen
    DNS server) is refused rather than silently ignored. Raises ValueError on a malformed target.
    """
    if not spec.startswith(DNS_SCHEME):
        return None
    parts = urlsplit(spec)
    if parts.netloc:
        raise ValueError(f"{spec!r}: a DNS server in the target is not supported; use dns:///NAME:PORT "
                         "(the system resolver answers)")
    name = parts.path.lstrip("/")
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{spec!r}: expected dns:///NAME:PORT, e.g. dns:///mmserve-encoder:50051")
    return DnsTarget(host.strip("[]"), int(port))


def resolve_system(host: str, port: int) -> list[str]:
    """Every IP address the system resolver gives for host (A and AAAA records), deduplicated."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def format_address(ip: str, port: int) -> str:
    """`ip:port`, with IPv6 addresses in brackets as gRPC targets want them."""
    try:
        is_v6 = ipaddress.ip_address(ip).version == 6
    except ValueError:  # a resolver that answers names: pass them through
        is_v6 = False
    return f"[{ip}]:{port}" if is_v6 else f"{ip}:{port}"


class GrpcHealthCheck:
    """Asks an encoder's `grpc.health.v1.Health/Check` (overall status, service ""); one cached channel
    per address."""

    def __init__(self, timeout_s: float = 1.0, tls: ClientTls | None = None) -> None:
        self.timeout_s = timeout_s
        self.tls = tls  # the encoder link's TLS: health checks go the same way as Encode
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def __call__(self, address: str) -> bool:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self.tls)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def forget(self, address: str) -> None:
        """Close the channel to an address that is gone from DNS."""
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


@dataclass
class _Member:
    """Health bookkeeping of one discovered address."""

    in_ring: bool = False
    ejected: bool = False  # left the ring on failed checks: needs admit_after good ones to return
    failures: int = 0   # consecutive failed checks
    successes: int = 0  # consecutive good checks


@dataclass(frozen=True)
class MembershipChange:
    """What one refresh did to the ring."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    members: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


class EncoderPool:
    """The encoders a decoder routes to: fixed addresses (healthy ones, when there are several encoders)
    plus every healthy address behind dns:/// targets.

    `route(content_hash)` is safe from any thread; `refresh()` runs one resolve-and-check round (the
    background thread started by `start()` calls it every interval_s seconds).
    """

    def __init__(self, specs: Sequence[str], resolver: Resolver = resolve_system,
                 health_check: HealthCheck | None = None, interval_s: float = 5.0,
                 eject_after: int = 2, admit_after: int = 1, replicas: int = 64) -> None:
        if not specs:
            raise ValueError("at least one encoder address is needed")
        if interval_s <= 0 or eject_after < 1 or admit_after < 1:
            raise ValueError("interval_s must be > 0, eject_after and admit_after >= 1")
        self.static: list[str] = []
        self.targets: list[DnsTarget] = []
        for spec in specs:
            target = parse_dns_target(spec)
            if target is None:
                self.static.append(spec)
            else:
                self.targets.append(target)
        self.interval_s = interval_s
        self.eject_after, self.admit_after = eject_after, admit_after
        self._resolver = resolver
        self._own_health_check = health_check is None
        self._health_check = health_check if health_check is not None else GrpcHealthCheck()
        self._members: dict[str, _Member] = {}                  # discovered address -> its health
        self._resolved: dict[DnsTarget, list[str]] = {t: [] for t in self.targets}
        self._ring: HashRing | None = HashRing(self.static, replicas) if self.static else None
        # Fixed addresses are checked only beside other encoders: a lone one has nowhere to fail over to.
        self.checks_static = len(self.static) + len(self.targets) > 1
        self._static_members = {a: _Member(in_ring=True) for a in self.static}
        self._replicas = replicas
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._checker = ThreadPoolExecutor(max_workers=8, thread_name_prefix="encoder-health")
        if self.targets:
            self.refresh()  # route from the first moment; an empty answer now is not fatal (see route)

    # -- routing -----------------------------------------------------------------------------------
    @property
    def members(self) -> list[str]:
        """The addresses in the ring now."""
        ring = self._ring
        return list(ring.addresses) if ring is not None else []

    addresses = members  # the name HashRing uses

    def route(self, key: str) -> str:
        """The encoder address that owns key now. Raises NoEncoderError when no encoder is serving."""
        ring = self._ring  # one read: a concurrent refresh swaps in a whole new ring
        if ring is None:
            raise NoEncoderError(f"no encoder is serving behind {', '.join(map(str, self.targets))}")
        return ring.route(key)

    # -- discovery -----------------------------------------------------------------------------------
    def refresh(self) -> MembershipChange:
        """Resolve every DNS target, health-check what it names, and rebuild the ring if it changed."""
        if not self.targets and not self.checks_static:
            return MembershipChange(members=tuple(self.members))
        discovered: list[str] = []
        for target in self.targets:
            try:
                ips = list(self._resolver(target.host, target.port))
                self._resolved[target] = [format_address(ip, target.port) for ip in ips]
            except OSError as exc:  # keep what the name had: a DNS hiccup must not empty the ring
                log.warning("resolving %s failed (%s); keeping its %d addresses", target, exc,
                            len(self._resolved[target]))
            discovered.extend(self._resolved[target])
        discovered = [a for a in dict.fromkeys(discovered) if a not in self.static]
        checked = discovered + (self.static if self.checks_static else [])
        healthy = dict(zip(checked, self._checker.map(self._health_check, checked), strict=True))
        with self._lock:
            before = self.members
            for address in [a for a in self._members if a not in healthy]:  # gone from DNS
                del self._members[address]
                if isinstance(self._health_check, GrpcHealthCheck):
                    self._health_check.forget(address)
            for address, ok in healthy.items():
                member = self._static_members.get(address) or self._members.setdefault(address, _Member())
                self._note(member, ok)
            static = [a for a in self.static if self._static_members[a].in_ring]
            ring_members = static + [a for a in discovered if self._members[a].in_ring]
            if not ring_members and self.static:  # none answers: keep routing to the fixed ones
                ring_members = list(self.static)
            if set(ring_members) != set(before):
                self._ring = HashRing(ring_members, self._replicas) if ring_members else None
            after = self.members
        change = MembershipChange(added=tuple(a for a in after if a not in before),
                                  removed=tuple(a for a in before if a not in after), members=tuple(after))
        if change.changed:
            log.info("encoders: +%s -%s -> %d in the ring", list(change.added), list(change.removed),
                     len(after))
            if not after:
                log.warning("no encoder is serving behind %s; images fail with UNAVAILABLE until one is",
                            ", ".join(map(str, self.targets)))
        return change

    def _note(self, member: _Member, ok: bool) -> None:
        """One health answer: eject after eject_after failures in a row, admit after good ones."""
        if ok:
            member.failures, member.successes = 0, member.successes + 1
        else:
            member.failures, member.successes = member.failures + 1, 0
        if not member.in_ring and member.successes >= (self.admit_after if member.ejected else 1):
            member.in_ring, member.ejected = True, False
        elif member.in_ring and member.failures >= self.eject_after:
            member.in_ring, member.ejected = False, True

    def start(self) -> None:
        """Re-resolve and re-check every interval_s seconds on a daemon thread (nothing to do for one
        fixed encoder)."""
        if not (self.targets or self.checks_static) or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="encoder-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - discovery must outlive one bad round
                log.exception("encoder discovery round failed")

    def close(self) -> None:
        """Stop the background thread and close the health-check channels."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        self._checker.shutdown(wait=True)
        if self._own_health_check and isinstance(self._health_check, GrpcHealthCheck):
            self._health_check.close()
