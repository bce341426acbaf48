"""The rule that decides whether a copied embedding can be trusted: the copy must have finished before
the lease could have lapsed, counting the TTL from when the Encode was sent (never later than the
encoder's own start of it), with a margin."""

from decoder_svc.encoders.remote_source import lease_held_through


def test_copy_inside_the_lease_is_trusted_and_late_ones_are_not():
    assert lease_held_through(sent_at=100.0, lease_expires_in_s=60.0, now=100.5)
    assert lease_held_through(sent_at=100.0, lease_expires_in_s=1.0, now=100.9)
    assert not lease_held_through(sent_at=100.0, lease_expires_in_s=1.0, now=100.99)  # inside the margin
    assert not lease_held_through(sent_at=100.0, lease_expires_in_s=1.0, now=101.5)
    assert not lease_held_through(sent_at=100.0, lease_expires_in_s=0.0, now=100.0)  # no lease at all
