"""The decoder front end's own calls to the encoders (the engine core makes the embedding fetches).

- `lookup`: the grids of hash-only images: how the front end tokenizes a Qwen-VL image it has no bytes
  of and has not hashed itself (its token count depends on the image's size). Best effort: an
  unreachable encoder, an absent entry or a video's entry (a video's hash given for an image) leaves the
  hash out of the answer, and the input processor then refuses the image with INVALID_ARGUMENT, asking
  for its bytes.
- `send_ahead`: a new image or video file goes to its encoder the moment its request arrives (a Prefetch
  with its bytes), so that the encoder decodes it and runs the tower while the request crosses to
  the engine core and is scheduled; the core's ask by hash then joins that work (the encoder makes a
  hash-only ask wait for a file it is decoding: encoder_svc/pending_files.py) instead of answering
  NOT_FOUND and having the core send the same megabytes again. Fire and forget: a failure changes
  nothing but the time (the core sends the bytes as before).

- `release_requests`: at shutdown, once the engine core is gone, the leases of the requests a drain timeout
  ended, by request id at every encoder (the core's lease-owner secret is the front end's).

Each hash goes to the encoder that owns it on the same consistent-hash ring the embedding fetches use,
under the request's cache salt (an entry made under another salt answers nothing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from common.client import CHANNEL_OPTIONS
from common.image_geometry import Grid
from common.pb import encoder_pb2, encoder_pb2_grpc
from common.security.client_auth import auth_metadata
from common.security.identity import tenant_of_salt
from common.security.tls import ClientTls, open_channel
from decoder_svc.encoders.discovery import EncoderPool, NoEncoderError

log = logging.getLogger("mmserve.decoder.front_link")


@dataclass(frozen=True)
class FileAhead:
    """A file to send ahead: its content hash, bytes, and the ImageInput fields of its settings (a
    Qwen-VL pixel range, a Gemma 3 crop choice: ImageSettings.input_fields) or, for a video, the
    VideoInput fields its plan resolved (so the encoder hashes it as the decoder did)."""

    content_hash: str
    data: bytes
    settings: dict = field(default_factory=dict)
    video: bool = False


def file_ahead(img) -> FileAhead | None:
    """What to send ahead for an image placeholder (engine/request.py) whose file the front end holds;
    None for one known by hash only, a PIL image, or a file already on its way to the core."""
    video = img.video
    if video is not None:
        if not isinstance(video.data, bytes):
            return None
        return FileAhead(img.content_hash, video.data, dict(fps=video.fps, max_frames=video.max_frames,
                                                            min_pixels=video.min_pixels,
                                                            max_pixels=video.max_pixels), video=True)
    if not isinstance(img.image, bytes):
        return None
    return FileAhead(img.content_hash, img.image, img.pixels.input_fields() if img.pixels else {})


class FrontEndLink:
    """Lookup and send-ahead Prefetch RPCs from the decoder's front end to the encoders (thread-safe)."""

    def __init__(self, pool: EncoderPool, tls: ClientTls | None = None, token: str | None = None,
                 timeout_s: float = 5.0) -> None:
        self.pool = pool
        self.pool.start()
        self._tls, self._token, self.timeout_s = tls, token, timeout_s
        self._stubs: dict[str, encoder_pb2_grpc.EncoderServiceStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def _stub(self, encoder: str) -> encoder_pb2_grpc.EncoderServiceStub:
        with self._lock:
            if encoder not in self._stubs:
                channel = open_channel(encoder, self._tls, CHANNEL_OPTIONS)
                self._channels.append(channel)
                self._stubs[encoder] = encoder_pb2_grpc.EncoderServiceStub(channel)
            return self._stubs[encoder]

    def lookup(self, content_hashes: Sequence[str], cache_salt: str = "") -> dict[str, Grid]:
        """{hash: (t, h, w)} for the hashes whose owning encoder holds them under cache_salt."""
        by_encoder: dict[str, list[str]] = {}
        for h in content_hashes:
            try:
                by_encoder.setdefault(self.pool.route(h), []).append(h)
            except NoEncoderError:
                return {}
        out: dict[str, Grid] = {}
        metadata = auth_metadata(self._token, tenant_of_salt(cache_salt))
        for encoder, hashes in by_encoder.items():
            try:
                reply = self._stub(encoder).Lookup(
                    encoder_pb2.LookupRequest(content_hashes=hashes, cache_salt=cache_salt),
                    timeout=self.timeout_s, metadata=metadata)
            except grpc.RpcError as exc:
                log.info("grid lookup at %s: %s", encoder, exc.code().name)
                continue
            for h, cached, grid in zip(hashes, reply.cached, reply.grids, strict=False):
                # A video's entry (it has timing) never stands for an image: left out like an absent one.
                is_video = bool(grid.video_timestamps) or grid.second_per_grid > 0
                if cached and len(grid.thw) == 3 and not is_video:
                    out[h] = (int(grid.thw[0]), int(grid.thw[1]), int(grid.thw[2]))
        return out

    def send_ahead(self, files: Sequence[FileAhead], cache_salt: str = "") -> int:
        """Send each file to its owning encoder as a Prefetch, without waiting for the answers; returns
        how many were sent (none while no encoder is known)."""
        metadata = auth_metadata(self._token, tenant_of_salt(cache_salt))
        sent = 0
        for f in files:
            try:
                encoder = self.pool.route(f.content_hash)
            except NoEncoderError:
                return sent
            request = encoder_pb2.PrefetchRequest(cache_salt=cache_salt, needed_now=True)
            (request.videos if f.video else request.images).add(data=f.data, **f.settings)  # no copy
            call = self._stub(encoder).Prefetch.future(request, timeout=self.timeout_s * 6, metadata=metadata)
            call.add_done_callback(_log_failure)
            sent += 1
        return sent

    def release_requests(self, request_ids: Sequence[str], lease_owner: str, timeout_s: float = 1.0) -> int:
        """Give back, at every encoder in the ring, every lease taken for `lease_owner` in answer to
        these requests' Encodes (the encoder frees an ask "R#..." by "R"): what a shutdown does for the
        requests it ended once its engine core is gone (stopped or killed), so that none waits for its
        TTL. Waits up to timeout_s for the answers; returns how many leases were freed."""
        if not request_ids or not lease_owner:
            return 0
        request = encoder_pb2.ReleaseRequest(request_ids=list(request_ids), lease_owner=lease_owner)
        calls = {encoder: self._stub(encoder).Release.future(request, timeout=timeout_s,
                                                             metadata=auth_metadata(self._token))
                 for encoder in self.pool.members}
        freed = 0
        for encoder, call in calls.items():
            try:
                freed += call.result().released
            except grpc.RpcError as exc:  # that encoder's TTL collects them
                log.warning("release of %d ended requests at %s: %s", len(request_ids), encoder,
                            exc.code().name)
        return freed

    def close(self) -> None:
        """Close the channels and the pool's background work."""
        self.pool.close()
        for channel in self._channels:
            channel.close()


def _log_failure(call: grpc.Future) -> None:
    if not call.cancelled() and call.exception() is not None:
        log.debug("send-ahead prefetch: %s", call.exception().code().name)
