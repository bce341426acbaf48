"""An image input takes only an image's entry and a video input only a video's (issue 38, item 7): a
video's content hash given as an image's (or the reverse) is refused with EntryKindError
(INVALID_ARGUMENT), ready or still in production, and the decoder's grid lookup for a hash-only image
leaves a video's entry out."""

from __future__ import annotations

import grpc
import pytest
import torch

from common.errors import status_of
from common.pb import common_pb2, encoder_pb2
from common.transport.arena import TensorArena
from common.video.rules import VideoTiming
from decoder_svc.encoders.discovery import EncoderPool
from decoder_svc.encoders.front_link import FrontEndLink
from encoder_svc.cache import EmbeddingCache, EntryKindError

VIDEO_KEY, IMAGE_KEY = "v" * 64, "i" * 64
TIMING = VideoTiming((0.25, 1.25), 1.0)


def test_each_kind_takes_only_its_own_entries() -> None:
    cache = EmbeddingCache(TensorArena(1 << 16))
    video, produce = cache.acquire(VIDEO_KEY, want_lease=False, video=True)
    assert produce
    with pytest.raises(EntryKindError, match="names a video; an image input takes only an image's hash"):
        cache.acquire(VIDEO_KEY, produce=False)  # while the video is in production
    cache.complete_many([(VIDEO_KEY, torch.ones(4, 8))], [(2, 2, 4)], [TIMING])
    assert video.result(1).entry.timing == TIMING
    with pytest.raises(EntryKindError) as error:
        cache.acquire(VIDEO_KEY, produce=False)  # ready
    assert status_of(error.value) == grpc.StatusCode.INVALID_ARGUMENT

    image, produce = cache.acquire(IMAGE_KEY, want_lease=False)
    cache.complete_many([(IMAGE_KEY, torch.ones(4, 8))], [(1, 4, 4)], [None])
    with pytest.raises(EntryKindError, match="names an image; a video input takes only a video's hash"):
        cache.acquire(IMAGE_KEY, produce=False, video=True)
    hit, _ = cache.acquire(VIDEO_KEY, want_lease=False, produce=False, video=True)
    assert hit.result(1).hit and cache.stats().active_leases == 0


class _LookupStub:
    def Lookup(self, request, **kwargs):  # noqa: N802 - the gRPC method's name
        video = common_pb2.ImageGrid(thw=[2, 4, 4], video_timestamps=[0.25, 1.25], second_per_grid=1.0)
        return encoder_pb2.LookupResponse(cached=[True, True],
                                          grids=[video, common_pb2.ImageGrid(thw=[1, 4, 4])])


def test_the_grid_lookup_for_an_image_leaves_a_video_out(monkeypatch) -> None:
    lookup = FrontEndLink(EncoderPool(["127.0.0.1:1"]))
    monkeypatch.setattr(lookup, "_stub", lambda encoder: _LookupStub())
    try:
        assert lookup.lookup([VIDEO_KEY, IMAGE_KEY]) == {IMAGE_KEY: (1, 4, 4)}
    finally:
        lookup.close()
