"""A bounded fuzz of GenerateRequest through the real decoder: every request gets a status (OK or a
client-side code), never INTERNAL, UNKNOWN or a hang, and a normal request is served right after."""

from __future__ import annotations

import math

import grpc
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from common.pb import common_pb2, decoder_pb2  # noqa: E402
from tests.integration.conftest import png  # noqa: E402
from tests.oracle import make_image  # noqa: E402

CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.RESOURCE_EXHAUSTED}
VALID_PNG = png(make_image(77, (20, 24)))

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, 1e-45, 1e-5, 0.7, 1.0, -1.0, math.nan, math.inf]))
images = st.one_of(st.just(VALID_PNG), st.binary(max_size=64), st.just(VALID_PNG[:40]),
                   st.text(max_size=70), st.sampled_from(["ab" * 32, "zz" * 32, ""]))
texts = st.one_of(st.text(max_size=60), st.sampled_from(["USER: <image>\nhi ASSISTANT:", "<image><image>",
                                                         "", "<image>"]))


@st.composite
def generate_requests(draw) -> decoder_pb2.GenerateRequest:
    sampling = decoder_pb2.SamplingParams(
        # Short generations, or more than the tiny model's context (1024): INVALID_ARGUMENT.
        max_tokens=draw(st.one_of(st.integers(0, 12), st.integers(1000, 5000))),
        temperature=draw(floats), top_p=draw(floats),
        top_k=draw(st.integers(-5, 70000)), stop=draw(st.lists(st.text(max_size=8), max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(-5, 70000), max_size=3)), ignore_eos=draw(st.booleans()),
        logprobs=draw(st.integers(0, 70000)))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    request = decoder_pb2.GenerateRequest(request_id=draw(st.text(max_size=20)), sampling=sampling,
                                          cache_salt=draw(st.text(max_size=20)))
    for img in draw(st.lists(images, max_size=3)):
        if isinstance(img, bytes):
            request.images.append(common_pb2.ImageInput(data=img))
        else:
            request.images.append(common_pb2.ImageInput(content_hash=img))
    if draw(st.booleans()):
        request.prompt = draw(texts)
    else:
        for role in draw(st.lists(st.sampled_from(["user", "assistant", "system", "{{ 7*7 }}", ""]),
                                  max_size=2)):
            message = request.chat.messages.add(role=role)
            message.content.add(text=draw(texts))
            if draw(st.booleans()):
                message.content.add(image=common_pb2.ImageInput(data=VALID_PNG))
    return request


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=generate_requests())
def test_any_generate_request_gets_a_status(pair, request):
    with pair.decoder_client(timeout=30) as client:
        try:
            for _ in client.stub.Generate(request, timeout=30):
                pass
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_CODES, (exc.code(), exc.details(), request)
            assert " at 0x" not in (exc.details() or "")
        # The service goes on serving.
        assert client.generate_text("USER: hi ASSISTANT:", max_tokens=2).finish_reason in ("LENGTH", "STOP")
