"""Bearer tokens, tenant scoping of salts and lease owners, service identities by token and by mTLS."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.client import EncoderClient
from common.health import health_status
from common.pb import encoder_pb2, encoder_pb2_grpc
from common.security.auth import AuthPolicy
from common.security.client_auth import auth_metadata
from common.security.identity import scoped_salt, tenant_of_salt
from common.security.options import ServerSecurity
from common.security.tls import ClientTls, ServerTls, open_channel
from common.security.tokens import TokenFileError, TokenTable
from tests.security.conftest import ALICE, BOB, DECODER, RecordingServicer, ServerThread


@pytest.fixture(scope="module")
def auth_server(tokens_file):
    servicer = RecordingServicer()
    server = ServerThread(servicer, ServerSecurity(auth=AuthPolicy(TokenTable.load(tokens_file)),
                                                   reflection=False))
    server.servicer = servicer
    yield server
    server.close()


def _lookup(server, token: str | None = None, salt: str = "", tenant: str | None = None) -> str:
    """Call Lookup and return the salt the servicer saw."""
    with open_channel(server.address, None) as channel:
        encoder_pb2_grpc.EncoderServiceStub(channel).Lookup(
            encoder_pb2.LookupRequest(content_hashes=["00" * 32], cache_salt=salt), timeout=5,
            metadata=auth_metadata(token, tenant))
    return server.servicer.seen[-1].cache_salt


def _code(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value.code()


def test_no_or_wrong_token_is_unauthenticated_and_a_good_token_serves(auth_server):
    calls = len(auth_server.servicer.seen)
    assert _code(_lookup, auth_server) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(_lookup, auth_server, token="wrong-token-0123456789") == grpc.StatusCode.UNAUTHENTICATED
    assert _code(_lookup, auth_server, token=ALICE[:-1]) == grpc.StatusCode.UNAUTHENTICATED
    with open_channel(auth_server.address, None) as channel:  # not a bearer header
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        assert _code(stub.Lookup, encoder_pb2.LookupRequest(), timeout=5,
                     metadata=(("authorization", f"Basic {ALICE}"),)) == grpc.StatusCode.UNAUTHENTICATED
    assert len(auth_server.servicer.seen) == calls  # the servicer never ran for them
    with EncoderClient(auth_server.address, timeout=5, token=ALICE) as client:
        assert client.stats().entries == 7
    assert auth_server.servicer.seen[-1].principal == "tenant:alice"


def test_health_needs_no_token_and_reflection_is_off_under_auth(auth_server):
    assert health_status(auth_server.address) == "SERVING"
    with open_channel(auth_server.address, None) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([request]), timeout=5,
                                           metadata=auth_metadata(ALICE)))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_on_request_still_needs_a_token(tokens_file):
    server = ServerThread(RecordingServicer(), ServerSecurity(auth=AuthPolicy(TokenTable.load(tokens_file)),
                                                              reflection=True))
    try:
        with open_channel(server.address, None) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            assert _code(lambda: list(stub.ServerReflectionInfo(iter([request]), timeout=5))) == \
                grpc.StatusCode.UNAUTHENTICATED
            replies = list(stub.ServerReflectionInfo(iter([request]), timeout=5, metadata=auth_metadata(BOB)))
            names = {s.name for s in replies[0].list_services_response.service}
            assert "mmserve.v1.EncoderService" in names
    finally:
        server.close()


def test_a_tenants_salt_is_forced_into_its_namespace(auth_server):
    assert _lookup(auth_server, ALICE, "shared") == "mmserve-tenant:alice:shared"
    assert _lookup(auth_server, BOB, "shared") == "mmserve-tenant:bob:shared"
    assert _lookup(auth_server, ALICE, "") == "mmserve-tenant:alice:"
    # Bob cannot write his way into Alice's namespace: his salt is prefixed like any other.
    assert _lookup(auth_server, BOB, "mmserve-tenant:alice:shared") == \
        "mmserve-tenant:bob:mmserve-tenant:alice:shared"
    assert auth_server.servicer.seen[-1].tenant == "bob"


def test_a_tenant_cannot_act_for_another_tenant(auth_server):
    assert _code(_lookup, auth_server, BOB, "x", tenant="alice") == grpc.StatusCode.PERMISSION_DENIED
    assert _lookup(auth_server, BOB, "x", tenant="bob") == "mmserve-tenant:bob:x"  # itself: fine


def test_a_service_acts_for_the_tenant_it_names(auth_server):
    assert _lookup(auth_server, DECODER, "x", tenant="alice") == "mmserve-tenant:alice:x"
    assert auth_server.servicer.seen[-1].principal == "service:decoder"
    # The decoder forwards salts it has already scoped: kept as they are.
    assert _lookup(auth_server, DECODER, "mmserve-tenant:alice:x", tenant="alice") == "mmserve-tenant:alice:x"
    # ... but cannot reach a tenant's namespace without naming that tenant.
    assert _code(_lookup, auth_server, DECODER, "mmserve-tenant:alice:x") == grpc.StatusCode.PERMISSION_DENIED
    assert _lookup(auth_server, DECODER, "plain") == "plain"


def test_lease_owners_are_bound_to_the_caller(auth_server):
    def release(token):
        with EncoderClient(auth_server.address, timeout=5, token=token, lease_owner="same-owner") as client:
            client.release(["lease-1"])
        return auth_server.servicer.seen[-1].lease_owner

    owners = {release(ALICE), release(BOB), release(DECODER)}
    assert owners == {"tenant:alice/same-owner", "tenant:bob/same-owner", "service:decoder/same-owner"}


def test_without_auth_the_tenant_namespace_is_closed():
    servicer = RecordingServicer()
    server = ServerThread(servicer)
    try:
        server.servicer = servicer
        assert _lookup(server, None, "mine") == "mine"
        assert _code(_lookup, server, None, "mmserve-tenant:alice:x") == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.close()


def test_a_client_certificate_can_be_a_service_identity(pki, tokens_file):
    tls = ServerTls.from_files(pki.server_cert, pki.server_key, client_ca=pki.ca_cert)
    policy = AuthPolicy(TokenTable.load(tokens_file), cert_services=frozenset({"decoder"}))
    servicer = RecordingServicer()
    server = ServerThread(servicer, ServerSecurity(tls=tls, auth=policy))
    try:
        server.servicer = servicer

        def stats(client_name, token=None):
            cert, key = pki.clients[client_name]
            with EncoderClient(server.address, timeout=5, token=token,
                               tls=ClientTls.from_files(pki.ca_cert, cert, key)) as client:
                client.stats()
            return servicer.seen[-1].principal

        assert stats("decoder") == "service:decoder"  # no token needed
        assert _code(stats, "client") == grpc.StatusCode.UNAUTHENTICATED  # a valid cert, but no service
        assert stats("client", token=ALICE) == "tenant:alice"
    finally:
        server.close()


def test_token_table_parsing_and_lookup():
    table = TokenTable.parse(f"tenant:a {ALICE}\n# comment\n\nb {BOB}  # trailing\nservice:d {DECODER}\n")
    assert str(table.lookup(ALICE)) == "tenant:a"
    assert str(table.lookup(BOB)) == "tenant:b"
    assert str(table.lookup(DECODER)) == "service:d"
    assert table.lookup("not-a-token-at-all") is None
    assert ALICE not in repr(table)
    for bad, message in ((f"tenant:a {ALICE} extra", "line 1"), ("tenant:a short", "shorter"),
                         (f"admin:a {ALICE}", "identity"), (f"tenant:a:b {ALICE}", "letters"),
                         (f"a {ALICE}\nb {ALICE}", "twice"), ("# nothing", "no tokens")):
        with pytest.raises(TokenFileError, match=message) as err:
            TokenTable.parse(bad)
        assert ALICE not in str(err.value)


def test_salt_scope_helpers():
    assert scoped_salt("a", "x") == "mmserve-tenant:a:x"
    assert scoped_salt("a", scoped_salt("a", "x")) == "mmserve-tenant:a:x"
    assert tenant_of_salt(scoped_salt("a", "x:y")) == "a"
    assert tenant_of_salt("x") is None
    assert tenant_of_salt("mmserve-tenant:") is None
