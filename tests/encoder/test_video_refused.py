"""A model without video support (LLaVA) answers a video with INVALID_ARGUMENT, before touching the cache."""

from __future__ import annotations

import grpc
import pytest

from common.pb import common_pb2, encoder_pb2
from tests.encoder.conftest import image_bytes
from tests.video.media import make_video


def test_llava_encoder_refuses_videos(encoder):
    before = encoder.stats()
    request = encoder_pb2.EncodeRequest(images=[common_pb2.ImageInput(data=image_bytes(1))],
                                        videos=[common_pb2.VideoInput(data=make_video(8))])
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Encode(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes no video input" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        encoder.stub.Prefetch(encoder_pb2.PrefetchRequest(videos=request.videos), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = encoder.stats()
    assert (after.misses, after.hits, after.encodes) == (before.misses, before.hits, before.encodes)
