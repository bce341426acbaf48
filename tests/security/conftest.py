"""Fixtures: a local PKI, a token file, and a GrpcService on a loop in a background thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from common.security.certs import LocalPki, make_local_pki
from common.security.identity import current_principal, current_tenant
from common.security.options import ServerSecurity

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef0"
DECODER = "decoder-service-token-0123456789"
TOKENS = f"""# test tokens
tenant:alice {ALICE}
bob          {BOB}     # a bare name is a tenant
service:decoder {DECODER}
"""


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> LocalPki:
    return make_local_pki(tmp_path_factory.mktemp("pki"), client_names=["decoder", "client"])


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory) -> LocalPki:
    """A second, unrelated CA: its certificates must not be trusted by the first one's servers."""
    return make_local_pki(tmp_path_factory.mktemp("other-pki"), client_names=["decoder"])


@pytest.fixture(scope="session")
def tokens_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(TOKENS)
    path.chmod(0o600)
    return path


@dataclass
class Seen:
    """What the recording servicer saw of one call, after the interceptor."""

    cache_salt: str = ""
    lease_owner: str = ""
    principal: str = ""
    tenant: str | None = None


class RecordingServicer(encoder_pb2_grpc.EncoderServiceServicer):
    """Answers Lookup/Release/GetStats and records the (scoped) requests and the caller's identity."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def _record(self, **fields) -> None:
        principal = current_principal()
        self.seen.append(Seen(principal=str(principal) if principal else "", tenant=current_tenant(),
                              **fields))

    async def Lookup(self, request, context):
        self._record(cache_salt=request.cache_salt)
        return encoder_pb2.LookupResponse(cached=[False] * len(request.content_hashes))

    async def Release(self, request, context):
        self._record(lease_owner=request.lease_owner)
        return encoder_pb2.ReleaseResponse(released=0)

    async def GetStats(self, request: common_pb2.StatsRequest, context):
        self._record()
        return encoder_pb2.EncoderStats(entries=7)


class ServerThread:
    """A GrpcService serving `servicer` as EncoderService, on its own loop in a daemon thread."""

    def __init__(self, servicer, security: ServerSecurity | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.service = self.call(self._make(servicer, security))
        self.port = self.call(self.service.start())
        self.loop.call_soon_threadsafe(self.service.set_serving, True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @staticmethod
    async def _make(servicer, security):
        from common.server import GrpcService

        service = GrpcService("security-test", "127.0.0.1", 0, security=security)
        service.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer,
                    "mmserve.v1.EncoderService")
        return service

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, *cleanups) -> None:
        """Stop the server, then await each cleanup() on its loop (e.g. a servicer's close)."""
        self.call(self.service.stop(0.2))
        for cleanup in cleanups:
            self.call(cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
