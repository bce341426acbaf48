"""A video URL's fetch errors name a video URL, in the message and the code, as an image URL's name an
image URL (issue 38, item 8): a private host, an HTTP error, a scheme the gateway does not fetch."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import APIError
from gateway.images import ImageFetcher, ImageFetchPolicy
from tests.gateway.harness import ImageServer
from tests.video.media import make_video

VIDEO = make_video(4, fps=10)


def _fetch_video(policy: ImageFetchPolicy, url: str) -> bytes:
    async def run() -> bytes:
        fetcher = ImageFetcher(policy)
        try:
            return await fetcher.fetch(url, "vid", kind="video")
        finally:
            await fetcher.close()

    return asyncio.run(run())


def test_video_url_errors_say_video_url() -> None:
    with ImageServer({"clip.mp4": VIDEO}) as server:
        assert _fetch_video(ImageFetchPolicy(allow_private=True), f"{server.url}/clip.mp4") == VIDEO
        cases = ((ImageFetchPolicy(), f"{server.url}/clip.mp4", "video_url_forbidden", "video URL host"),
                 (ImageFetchPolicy(allow_private=True), f"{server.url}/missing.mp4", "video_fetch_failed",
                  "fetching the video URL answered HTTP 404"),
                 (ImageFetchPolicy(), "ftp://example.com/clip.mp4", None, "video_url must be a data:"))
        for policy, url, code, words in cases:
            with pytest.raises(APIError) as err:
                _fetch_video(policy, url)
            message = err.value.message.replace("--allow-private-image-urls", "")  # the flag's own name
            assert words in message and "image" not in message, message
            assert code is None or err.value.code == code
