"""Tenant isolation at a real encoder (tiny model) under bearer tokens, and the decoder's link to it
over mutual TLS (RemoteEmbeddingSource, the component the decoder uses)."""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.client import EncoderClient
from common.hashing import hash_image_file
from common.images import encode_png
from common.pb import common_pb2
from common.security.auth import AuthPolicy
from common.security.identity import scoped_salt
from common.security.options import ServerSecurity
from common.security.tls import ClientTls, ServerTls
from common.security.tokens import TokenTable
from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingState
from encoder_svc.server import EncoderConfig, EncoderServicer
from tests.oracle import make_image
from tests.security.conftest import ALICE, BOB, DECODER, ServerThread

SHM = common_pb2.TRANSPORT_SHM


@pytest.fixture(scope="module")
def encoder(tiny_model_dir, pki, tokens_file):
    """A real encoder under mutual TLS and tokens; the `decoder` certificate is a service identity."""
    servicer = EncoderServicer.build(EncoderConfig(model=tiny_model_dir, cache_bytes=1 << 20),
                                     registry=CollectorRegistry())
    security = ServerSecurity(
        tls=ServerTls.from_files(pki.server_cert, pki.server_key, client_ca=pki.ca_cert),
        auth=AuthPolicy(TokenTable.load(tokens_file), cert_services=frozenset({"decoder"})), reflection=False)
    server = ServerThread(servicer, security)
    server.call(servicer.warm_up())
    server.servicer = servicer
    yield server
    server.close(servicer.close)  # the arena's SHM segment goes with it


def _tls(pki, client: str | None = "client") -> ClientTls:
    cert, key = pki.clients[client] if client else (None, None)
    return ClientTls.from_files(pki.ca_cert, cert, key)


def _client(encoder, pki, token: str, lease_owner: str | None = None) -> EncoderClient:
    return EncoderClient(encoder.address, timeout=30, tls=_tls(pki), token=token, lease_owner=lease_owner)


def test_a_tenant_cannot_read_another_tenants_embedding_by_hash(encoder, pki):
    image = encode_png(make_image(71))
    with _client(encoder, pki, ALICE) as alice, _client(encoder, pki, BOB) as bob:
        ref = alice.encode([image], cache_salt="team").embeddings[0]
        digest = ref.content_hash
        # Alice reads it back by hash (a cache hit); Bob, whatever salt he sends, gets NOT_FOUND.
        assert alice.encode([f"hash:{digest}"], cache_salt="team").embeddings[0].cache_hit
        for salt in ("team", "", scoped_salt("alice", "team")):
            with pytest.raises(grpc.RpcError) as err:
                bob.encode([f"hash:{digest}"], cache_salt=salt)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert bob.lookup([digest], cache_salt=salt) == [False]
        assert alice.lookup([digest], cache_salt="team") == [True]
        # The same picture sent by Bob is his own entry, under another hash: no hit on Alice's work.
        mine = bob.encode([image], cache_salt="team").embeddings[0]
        assert mine.content_hash != digest and not mine.cache_hit


def test_a_tenant_cannot_release_another_tenants_lease(encoder, pki):
    image = encode_png(make_image(72))
    # All use the same lease_owner string: under auth, owners are bound to the caller. Leases are held by
    # services (the decoder): a tenant gets inline bytes only, never a ref into the shared arena.
    with _client(encoder, pki, DECODER, "owner") as service, _client(encoder, pki, ALICE, "owner") as alice, \
            _client(encoder, pki, BOB, "owner") as bob:
        inline = alice.encode([image], accept=[SHM]).embeddings[0]
        assert inline.WhichOneof("location") == "inline_data" and not inline.lease_id
        before = alice.stats().active_leases
        ref = service.encode([image], accept=[SHM]).embeddings[0]
        assert ref.WhichOneof("location") == "shm" and ref.lease_id
        assert alice.release([ref.lease_id]) == 0
        assert bob.release([ref.lease_id]) == 0
        assert alice.stats().active_leases == before + 1
        assert service.release([ref.lease_id]) == 1
        assert alice.stats().active_leases == before


def _fetch(source: RemoteEmbeddingSource, req: EmbeddingRequest, timeout: float = 30.0) -> EmbeddingState:
    source.request(req)
    deadline = time.monotonic() + timeout
    while source.poll(req.request_id, req.content_hash) == EmbeddingState.PENDING:
        assert time.monotonic() < deadline, "the fetch neither finished nor failed"
        time.sleep(0.02)
    return source.poll(req.request_id, req.content_hash)


def test_the_decoder_link_works_over_mtls_and_keeps_the_tenant(encoder, pki, tiny_model_dir):
    image = make_image(73)
    salt = scoped_salt("alice", "")  # what the decoder's auth interceptor made of Alice's request
    digest = hash_image_file(encode_png(image), encoder.servicer.vision.fingerprint, salt)
    req = EmbeddingRequest("r1", digest, encode_png(image), cache_salt=salt)
    source = RemoteEmbeddingSource([encoder.address], tls=_tls(pki, "decoder"),
                                   retry=RetryPolicy(total_timeout_s=20))
    try:
        assert _fetch(source, req) == EmbeddingState.READY, source.error("r1", digest)
        assert tuple(source.get("r1", digest).shape) == (16, 64)
        source.release("r1")
    finally:
        source.close()
    # The entry was made in Alice's namespace: hers by hash, not Bob's.
    with _client(encoder, pki, ALICE) as alice, _client(encoder, pki, BOB) as bob:
        assert alice.lookup([digest]) == [True]
        assert bob.lookup([digest]) == [False]
        assert alice.stats().active_leases == 0  # the link gave its lease back


def test_the_decoder_link_without_its_certificate_is_refused(encoder, pki):
    image = make_image(74)
    digest = hash_image_file(encode_png(image), encoder.servicer.vision.fingerprint, "")
    req = EmbeddingRequest("r2", digest, encode_png(image))
    source = RemoteEmbeddingSource([encoder.address], tls=_tls(pki, None),
                                   retry=RetryPolicy(total_timeout_s=1.0, attempt_timeout_s=0.5))
    try:
        assert _fetch(source, req) == EmbeddingState.FAILED
        assert source.pop_error_code("r2") == "UNAVAILABLE"
    finally:
        source.close()


def test_a_decoder_the_encoder_does_not_accept_fails_its_images_as_internal(encoder, pki):
    """A valid certificate that is no service, and no token: the encoder says UNAUTHENTICATED, which
    is the decoder's misconfiguration, not its client's, so the request fails INTERNAL."""
    image = make_image(75)
    digest = hash_image_file(encode_png(image), encoder.servicer.vision.fingerprint, "")
    req = EmbeddingRequest("r3", digest, encode_png(image))
    source = RemoteEmbeddingSource([encoder.address], tls=_tls(pki, "client"),
                                   retry=RetryPolicy(total_timeout_s=5.0))
    try:
        assert _fetch(source, req) == EmbeddingState.FAILED
        assert "UNAUTHENTICATED" in source.error("r3", digest)
        assert source.pop_error_code("r3") == "INTERNAL"
    finally:
        source.close()


def test_the_decoder_link_can_authenticate_with_a_service_token(encoder, pki):
    image = make_image(76)
    salt = scoped_salt("bob", "x")
    digest = hash_image_file(encode_png(image), encoder.servicer.vision.fingerprint, salt)
    req = EmbeddingRequest("r4", digest, encode_png(image), cache_salt=salt)
    # The `client` certificate is no service: the token makes this link service:decoder.
    source = RemoteEmbeddingSource([encoder.address], tls=_tls(pki, "client"), token=DECODER,
                                   retry=RetryPolicy(total_timeout_s=20))
    try:
        assert _fetch(source, req) == EmbeddingState.READY, source.error("r4", digest)
        source.release("r4")
    finally:
        source.close()
    with _client(encoder, pki, BOB) as bob, _client(encoder, pki, ALICE) as alice:
        assert bob.lookup([digest], cache_salt="x") == [True]
        assert alice.lookup([digest], cache_salt="x") == [False]
