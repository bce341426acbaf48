"""The decoder's front end gives memory back after a flood of requests carrying files of a few MB each
(RELIABILITY.md, "Faults under load": the decoder +23% RSS after 7 MB data URLs; nothing trimmed there)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from common.errors import InvalidInputError, ServiceError
from common.memory_return import MemoryReturn
from common.pb import common_pb2, decoder_pb2
from decoder_svc.input_lanes import InputLanes
from decoder_svc.server import DecoderServicer


class RefusingCore:
    """An engine-core client stand-in; the requests never reach it (the inputs refuse them)."""

    num_open_streams = 0

    def open_stream(self, request_id: str) -> asyncio.Queue:
        return asyncio.Queue()

    def close_stream(self, request_id: str) -> None:
        pass

    async def abort(self, request_id: str) -> bool:
        return False


def _refuse(new_request):
    raise InvalidInputError("refused after its bytes were read")


def _servicer() -> DecoderServicer:
    inputs = SimpleNamespace(config=SimpleNamespace(encoder_max_ahead=1), make=_refuse,
                             tokenizer=SimpleNamespace(tokenizer=None), layout=None)
    servicer = DecoderServicer(core=RefusingCore(), inputs=inputs, lanes=InputLanes(1, 1))
    servicer.memory = MemoryReturn(delay_s=0.0, trim=lambda: True)
    return servicer


def _request(nbytes: int) -> decoder_pb2.GenerateRequest:
    image = common_pb2.ImageInput(data=b"x" * nbytes)
    return decoder_pb2.GenerateRequest(prompt="<image> hi", images=[image])


def _flood(servicer: DecoderServicer, requests: int, nbytes: int) -> None:
    async def one() -> None:
        with pytest.raises(ServiceError) as refused:
            async for _ in servicer.Generate(_request(nbytes), context=None):
                pass
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT

    async def run() -> None:
        await asyncio.gather(*(one() for _ in range(requests)))
        await asyncio.sleep(0.01)  # the scheduled trim's turn

    asyncio.run(run())
    servicer.lanes.shutdown()


def test_a_flood_of_7_mb_requests_is_followed_by_a_trim_and_a_collection():
    servicer = _servicer()
    _flood(servicer, 12, 7_000_000)
    assert servicer.heavy_open == 0
    assert servicer.memory.trims >= 1  # none before: the front end never trimmed after such requests
    assert servicer.memory.collections == 1  # the burst's end: the failed requests' cycles go too


def test_text_sized_requests_do_not_trim():
    servicer = _servicer()
    _flood(servicer, 4, 1000)
    assert (servicer.memory.trims, servicer.memory.since_trim) == (0, 0)
