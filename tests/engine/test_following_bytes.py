"""Image files that follow their request to the engine core (decoder_svc/engine/following_bytes.py), and
the core's wake-up when an embedding arrives (decoder_svc/engine_core.py)."""

from __future__ import annotations

import pickle
import threading
from multiprocessing.connection import wait

import pytest

from decoder_svc.encoders.encode_items import image_bytes
from decoder_svc.engine.embedding_source import EmbeddingSource, VideoSource
from decoder_svc.engine.following_bytes import (
    BytesNeverCameError,
    FollowingBytes,
    awaiting_files,
    detach_files,
    file_bytes,
)
from decoder_svc.engine.request import ImagePlaceholder
from decoder_svc.engine_core import Wakeup


def test_the_bytes_never_travel_inside_the_request():
    holder = FollowingBytes(3)
    holder.set(b"abc")
    copy = pickle.loads(pickle.dumps(holder))
    assert copy.size == 3 and len(copy) == 3
    with pytest.raises(BytesNeverCameError, match="3 bytes"):
        copy.get(timeout=0.01)
    assert holder.get(timeout=0) == b"abc"


def test_a_reader_waits_for_bytes_set_by_another_thread():
    holder = FollowingBytes(4)
    threading.Timer(0.05, holder.set, args=(b"data",)).start()
    assert image_bytes(holder, timeout=30.0) == b"data"  # set later, by the timer's thread


def test_detach_leaves_holders_in_order_and_keeps_hash_only_and_pil_images():
    a, b = b"file-a", b"file-bb"
    images = [ImagePlaceholder(0, 1, "h1", a), ImagePlaceholder(5, 1, "h2", None),
              ImagePlaceholder(9, 1, "h3", b)]
    files = detach_files(images)
    assert files == [a, b]
    assert images[1].image is None and [h.size for h in awaiting_files(images)] == [len(a), len(b)]
    for holder, data in zip(awaiting_files(images), files, strict=True):
        holder.set(data)
    assert [image_bytes(img.image, 0) for img in (images[0], images[2])] == [a, b]


def test_a_video_file_follows_once_for_all_its_placeholders():
    """A Qwen3-VL video fills one placeholder per group of frames, all sharing its VideoSource: its file
    leaves the request once, and after the crossing (pickled, as on the core's pipe) every placeholder
    still shares the one holder that the file fills."""
    image, clip = b"image-file", b"video-file-bytes"
    video = VideoSource(clip, fps=2.0)
    places = [ImagePlaceholder(0, 4, "v", video=video), ImagePlaceholder(9, 1, "i", image),
              ImagePlaceholder(12, 4, "v", row_offset=4, video=video)]
    files = detach_files(places)
    assert files == [clip, image]
    assert places[0].video is places[2].video and places[0].video.fps == 2.0
    crossed = pickle.loads(pickle.dumps(places))
    holders = awaiting_files(crossed)
    assert [h.size for h in holders] == [len(clip), len(image)]
    for holder, data in zip(holders, files, strict=True):
        holder.set(data)
    assert crossed[0].video.data is crossed[2].video.data
    assert file_bytes(crossed[2].video.data, 0) == clip and file_bytes(crossed[1].image, 0) == image
    assert file_bytes(b"as given", 0) == b"as given"


def test_an_arriving_embedding_wakes_the_core_and_the_wake_is_drained():
    wakeup = Wakeup()
    try:
        class Source(EmbeddingSource):
            request = poll = get = release = None

        source = Source.__new__(Source)
        source.on_change = wakeup.set
        assert wait([wakeup.reader], 0) == []
        threading.Timer(0.05, source.notify_change).start()
        assert wait([wakeup.reader], 30.0) == [wakeup.reader]  # woken by the poke, not the timeout
        for _ in range(3):  # several pokes before the loop looks: one wake, then drained
            source.notify_change()
        wakeup.clear()
        assert wait([wakeup.reader], 0) == []
    finally:
        wakeup.close()
