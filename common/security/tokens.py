"""The bearer-token file: which token is which identity.

One entry a line, `IDENTITY TOKEN`; `#` starts a comment:

    # identity          token (16 characters at least; `openssl rand -hex 32` makes a good one)
    tenant:acme         5b0e0c7c0d0b4c6f9f1e2a3d4c5b6a79
    globex              0f9e8d7c6b5a49382716051423324150     # a bare name is a tenant
    service:decoder     a1b2c3d4e5f60718293a4b5c6d7e8f90     # may act for any tenant (x-mmserve-tenant)

Several tokens may name one identity (rotation: add the new one, move clients, drop the old one).
Only SHA-256 digests of the tokens are kept, and a token is checked against every entry with
hmac.compare_digest, so the time taken does not depend on which entry (if any) matched or where.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from common.security.identity import SERVICE, TENANT, Principal

log = logging.getLogger("mmserve.security")

MIN_TOKEN_CHARS = 16


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file and line, never a token."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class TokenTable:
    """Maps bearer tokens to principals in constant time."""

    def __init__(self, entries: list[tuple[str, Principal]]) -> None:
        seen: set[bytes] = set()
        self._entries: list[_Entry] = []
        for token, principal in entries:
            digest = _digest(token)
            if digest in seen:
                raise TokenFileError(f"a token is listed twice (second time for {principal})")
            seen.add(digest)
            self._entries.append(_Entry(digest, principal))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:  # never the tokens, not even their digests
        return f"TokenTable({len(self)} tokens)"

    def lookup(self, token: str) -> Principal | None:
        """The principal of token, or None. Compares against every entry: no early exit."""
        digest = _digest(token)
        found = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        return found

    def principals(self) -> set[Principal]:
        return {e.principal for e in self._entries}

    @classmethod
    def parse(cls, text: str, source: str = "token file") -> TokenTable:
        """Parse the file format above; raises TokenFileError naming the line (never the token)."""
        entries = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) != 2:
                raise TokenFileError(f"{source} line {number}: expected `IDENTITY TOKEN`")
            identity, token = fields
            kind, sep, name = identity.partition(":")
            if not sep:
                kind, name = TENANT, identity
            if kind not in (TENANT, SERVICE):
                raise TokenFileError(f"{source} line {number}: identity must be tenant:NAME, service:NAME "
                                     f"or NAME, not {identity!r}")
            try:
                principal = Principal(kind, name)
            except ValueError as exc:
                raise TokenFileError(f"{source} line {number}: {exc}") from None
            if len(token) < MIN_TOKEN_CHARS:
                raise TokenFileError(f"{source} line {number}: the token of {principal} is shorter than "
                                     f"{MIN_TOKEN_CHARS} characters")
            entries.append((token, principal))
        try:
            table = cls(entries)
        except TokenFileError as exc:
            raise TokenFileError(f"{source}: {exc}") from None
        if not table:
            raise TokenFileError(f"{source}: no tokens in it")
        return table

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Read a token file; warns when others than its owner may read it."""
        path = Path(path)
        try:
            text = path.read_text()
            mode = path.stat().st_mode
        except OSError as exc:
            raise TokenFileError(f"--auth-tokens {path}: {exc.strerror}") from None
        if os.name == "posix" and mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("%s is readable by other users: chmod 600 it", path)
        return cls.parse(text, str(path))


def read_token(path: str | Path) -> str:
    """A client's own token from a file (its first non-empty, non-comment line)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TokenFileError(f"token file {path}: {exc.strerror}") from None
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return line
    raise TokenFileError(f"token file {path}: empty")
