"""Embedding leases seen from the decoder: a fetched embedding counts only if it was copied out of the
encoder's arena while its lease provably held (the encoder may reuse the slice once it lapses)."""

from __future__ import annotations

LEASE_MARGIN_S = 0.05  # clock and scheduling slack between our timer and the encoder's


class LeaseLapsedError(RuntimeError):
    """An embedding could not be copied out within its lease, twice."""


def lease_held_through(sent_at: float, lease_expires_in_s: float, now: float) -> bool:
    """True when a lease granted in reply to a request sent at `sent_at` (monotonic) was still valid at
    `now`: the encoder counts its TTL from no earlier than the send."""
    return now < sent_at + lease_expires_in_s - LEASE_MARGIN_S
