"""Content hash of a video: the key its embeddings are cached under and prefix KV reuse is keyed by.

It is made from the encoded container bytes, not from decoded frames: blake3 (common/hashing.py's
framed record) over the bytes and a fingerprint of everything else that decides the embedding: the
model, the frame sampling (fps, min/max frames), the resize (pixel range, patch sizes), normalisation
and the tenant's cache salt. The bytes and those parameters fix the sampled frames and their pixels
(decoding is deterministic), so this identifies the embedding as well as a hash of the frames would,
and a decoder can compute it at admission from the request's bytes alone: hashing decoded frames would
need a full decode of the video there, before the request is even queued. Both services call
`hash_video_bytes` with the same resolved config (common/video/request.py), so they agree on the key.

The same file re-encoded (other bytes, same pictures) is another entry: the price of not decoding.
"""

from __future__ import annotations

from common.hashing import framed_digest
from common.video.rules import VideoConfig

_DOMAIN = b"mmserve.video.v1"


def video_fingerprint(model_fingerprint: str, config: VideoConfig) -> str:
    """The fingerprint a video's hash is made under: the model and every processing parameter."""
    return f"{model_fingerprint}|video|{config.key()}"


def hash_video_bytes(data: bytes | memoryview, config: VideoConfig, model_fingerprint: str,
                     cache_salt: str = "") -> str:
    """Hex content hash of an encoded video file processed under config (no frame is decoded)."""
    return framed_digest(_DOMAIN, [
        (b"model", video_fingerprint(model_fingerprint, config).encode()),
        (b"salt", cache_salt.encode()),
        (b"container", data),
    ]).hex()
