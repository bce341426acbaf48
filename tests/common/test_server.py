"""The shared server skeleton: health, reflection, status mapping, clean stop."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.errors import not_found
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from common.server import GrpcService


class _Servicer(encoder_pb2_grpc.EncoderServiceServicer):
    async def Lookup(self, request, context):
        if not request.content_hashes:
            raise not_found("nothing to look up")
        raise RuntimeError("boom in lookup")

    async def GetStats(self, request, context):
        return encoder_pb2.EncoderStats(entries=7)


async def _health(channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


def test_skeleton_health_reflection_errors_and_stop():
    async def scenario():
        server = GrpcService("test", port=0)
        server.add(encoder_pb2_grpc.add_EncoderServiceServicer_to_server, _Servicer(),
                   "mmserve.v1.EncoderService")
        port = await server.start()
        assert port > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            server.set_serving(True)
            await asyncio.sleep(0.05)
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert await _health(channel, "mmserve.v1.EncoderService") == \
                health_pb2.HealthCheckResponse.SERVING

            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = [r async for r in refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
            names = {s.name for s in replies[0].list_services_response.service}
            assert {"mmserve.v1.EncoderService", "grpc.health.v1.Health"} <= names

            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            assert (await stub.GetStats(common_pb2.StatsRequest())).entries == 7
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(encoder_pb2.LookupRequest())
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "nothing to look up" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(encoder_pb2.LookupRequest(content_hashes=["x"]))
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "RuntimeError: boom in lookup" in err.value.details()
            # The service goes on serving after a failure.
            assert (await stub.GetStats(common_pb2.StatsRequest())).entries == 7

        waiter = asyncio.create_task(server.wait(grace=1.0))
        await asyncio.sleep(0.05)
        server.request_stop()
        await asyncio.wait_for(waiter, timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await encoder_pb2_grpc.EncoderServiceStub(channel).GetStats(
                    common_pb2.StatsRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())
