"""ImageInput.pan_and_scan at a LLaVA encoder service: true is INVALID_ARGUMENT naming the image (only
Gemma 3 crops); false asks for what the model does and is served, under the same hash as unset."""

from __future__ import annotations

import grpc
import pytest

from common.pb import common_pb2, encoder_pb2
from tests.encoder.conftest import image_bytes


def test_true_is_refused_naming_the_image_false_is_served(encoder) -> None:
    good = image_bytes(7)
    request = encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=good),
                                                common_pb2.ImageInput(data=good, pan_and_scan=True)],
                                        accept=[common_pb2.TRANSPORT_INLINE])
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image 1: pan_and_scan" in err.value.details() and "Gemma 3" in err.value.details()
    served = encoder.stub.Encode(encoder_pb2.EncodeRequest(
        images=[common_pb2.ImageInput(data=good, pan_and_scan=False), common_pb2.ImageInput(data=good)],
        accept=[common_pb2.TRANSPORT_INLINE]), timeout=30)
    first, second = served.embeddings
    assert first.content_hash == second.content_hash and list(first.shape) == list(second.shape)
