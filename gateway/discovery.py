"""Which decoders the gateway balances: fixed addresses, and addresses found each round.

    --decoder HOST:PORT              one decoder, always listed
    --decoder dns:///NAME:PORT       every address behind NAME (a headless Service: one A record per
                                     ready Pod), resolved again every round
    --decoder file:PATH              the HOST:PORT lines of a file (blank lines and # comments skipped),
                                     read again every round: a replacement written there is found without
                                     a restart (what bench/chaos.py uses on one machine)

A lookup or read that fails keeps what that target gave last time: a resolver hiccup must not empty the
pool. The pool (balancer.py) adds what appears and retires what is gone once its calls have ended.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from decoder_svc.encoders.discovery import Resolver, format_address, parse_dns_target, resolve_system

log = logging.getLogger("mmserve.gateway")

FILE_SCHEME = "file:"


def file_addresses(path: Path) -> list[str]:
    """The HOST:PORT lines of a file; OSError when it cannot be read."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def check_target(spec: str) -> None:
    """ValueError for a malformed dns:/// target or an empty file: path."""
    if spec.startswith(FILE_SCHEME):
        if not spec[len(FILE_SCHEME):].strip():
            raise ValueError(f"--decoder {spec!r}: expected file:PATH")
        return
    parse_dns_target(spec)


@dataclass
class DecoderTargets:
    """The --decoder specs, and what each dynamic one gave at its last good lookup."""

    specs: Sequence[str]
    resolver: Resolver = resolve_system
    _last: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for spec in self.specs:
            check_target(spec)

    @property
    def dynamic(self) -> bool:
        """Whether any target can change (then the pool looks again every round)."""
        return any(s.startswith(FILE_SCHEME) or parse_dns_target(s) is not None for s in self.specs)

    def addresses(self) -> list[str]:
        """Every address the targets name now, deduplicated, in target order."""
        out: list[str] = []
        for spec in self.specs:
            out.extend(self._expand(spec))
        return list(dict.fromkeys(out))

    def _expand(self, spec: str) -> list[str]:
        dns = parse_dns_target(spec)
        if dns is None and not spec.startswith(FILE_SCHEME):
            return [spec]
        try:
            if dns is not None:
                found = [format_address(ip, dns.port) for ip in self.resolver(dns.host, dns.port)]
            else:
                found = file_addresses(Path(spec[len(FILE_SCHEME):]))
        except OSError as exc:  # keep what it gave last time
            log.warning("decoder target %s: %s; keeping its %d addresses", spec, exc,
                        len(self._last.get(spec, [])))
            return self._last.get(spec, [])
        self._last[spec] = found
        return found
