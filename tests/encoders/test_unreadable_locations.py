"""An encoder whose SHM segment (or GPU) this decoder cannot open, as from another host, container or
Pod: the first image costs a second Encode for the bytes; later images from that encoder are asked for
without that transport, until the memory of it expires. No encoder is needed (a fake stub)."""

from __future__ import annotations

import types

import numpy as np

from common.pb import common_pb2, encoder_pb2
from decoder_svc.encoders import remote_source, transport_choice
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource
from decoder_svc.engine.embedding_source import EmbeddingRequest
from tests.encoders.fake_calls import FakeMethod

ENCODER = "127.0.0.1:1"
ROWS = np.arange(6, dtype=np.float32).reshape(2, 3)


class _ElsewhereStub:
    """Answers with a segment that does not exist here while SHM is acceptable, else inline rows."""

    def __init__(self) -> None:
        self.accepts: list[list[int]] = []
        self.Encode = FakeMethod(self._encode)
        self.Release = FakeMethod(lambda request, **kwargs: None)

    def _encode(self, request, **kwargs):
        self.accepts.append(list(request.accept))
        ref = common_pb2.EmbeddingRef(dtype=common_pb2.DTYPE_FLOAT32, shape=list(ROWS.shape),
                                      nbytes=ROWS.nbytes)
        if common_pb2.TRANSPORT_SHM in request.accept:
            ref.shm.name = "mmserve-on-another-host"
            ref.lease_id = "lease-1"
            ref.lease_expires_in_s = 30.0
        else:
            ref.inline_data = ROWS.tobytes()
        return encoder_pb2.EncodeResponse(embeddings=[ref])


def test_a_location_we_cannot_open_is_not_asked_for_again_until_it_expires(monkeypatch):
    shm, inline = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE
    source = RemoteEmbeddingSource([ENCODER], transports=[shm, inline])
    stub = _ElsewhereStub()
    monkeypatch.setattr(source, "_stub", lambda encoder: stub)
    monkeypatch.setattr(source, "_release_leases", lambda encoder, ids, asks=(): None)
    try:
        def fetch(i: int) -> None:
            req = EmbeddingRequest(f"r{i}", f"{i:02x}" * 32, None)
            _, tensor = source._fetch_owned(ENCODER, req, deadline=remote_source.time.monotonic() + 30)
            assert tensor.numpy().tolist() == ROWS.tolist()

        fetch(0)
        assert stub.accepts == [[shm, inline], [inline]]  # the segment is elsewhere: the bytes instead
        fetch(1), fetch(2)
        assert stub.accepts[2:] == [[inline], [inline]]  # one Encode each, not two
        assert source.accept_for("127.0.0.1:2") == [shm, inline]  # other encoders are not affected
        later = remote_source.time.monotonic() + transport_choice.UNREADABLE_TTL_S + 1
        monkeypatch.setattr(transport_choice, "time", types.SimpleNamespace(monotonic=lambda: later))
        assert source.accept_for(ENCODER) == [shm, inline]  # asked again after a while
    finally:
        source.close()


def test_a_location_we_cannot_open_is_asked_for_again_by_nixl_before_the_bytes(monkeypatch):
    """With NIXL readable here, the second Encode for an SHM segment on another host asks for NIXL first
    (any host, no copy through gRPC), then the bytes."""
    shm, nixl, inline = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_NIXL, common_pb2.TRANSPORT_INLINE
    source = RemoteEmbeddingSource([ENCODER], transports=[shm, nixl, inline])
    stub = _ElsewhereStub()
    monkeypatch.setattr(source, "_stub", lambda encoder: stub)
    monkeypatch.setattr(source, "_release_leases", lambda encoder, ids, asks=(): None)
    try:
        req = EmbeddingRequest("r0", "ab" * 32, None)
        _, tensor = source._fetch_owned(ENCODER, req, deadline=remote_source.time.monotonic() + 30)
        assert tensor.numpy().tolist() == ROWS.tolist()
        assert stub.accepts == [[shm, nixl, inline], [nixl, inline]]
        assert source.accept_for(ENCODER) == [nixl, inline]  # SHM alone is left out from now on
    finally:
        source.close()


def test_the_fallback_for_an_unreadable_location():
    """NIXL, where accepted and not what failed, then the bytes."""
    shm, nixl, inline = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_NIXL, common_pb2.TRANSPORT_INLINE
    elsewhere = common_pb2.EmbeddingRef(shm=common_pb2.ShmLocation(name="mmserve-not-on-this-host"))
    gpu = common_pb2.EmbeddingRef(cuda_ipc=common_pb2.CudaIpcLocation(device_uuid="00" * 16))
    failed_nixl = common_pb2.EmbeddingRef(nixl=common_pb2.NixlLocation(agent_name="elsewhere"))
    choice = transport_choice.TransportChoice([common_pb2.TRANSPORT_CUDA_IPC, shm, nixl, inline])
    assert choice.across_hosts(elsewhere) == [nixl, inline]
    assert choice.across_hosts(gpu) == [nixl, inline]
    assert choice.across_hosts(failed_nixl) == [inline]
    assert transport_choice.TransportChoice([shm, inline]).across_hosts(elsewhere) == [inline]
