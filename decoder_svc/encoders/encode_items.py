"""What an Encode carries: an image or video by its content hash, or with its bytes."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from common.images import encode_png
from common.pb import encoder_pb2
from decoder_svc.engine.embedding_source import EmbeddingRequest
from decoder_svc.engine.following_bytes import FollowingBytes, file_bytes


@dataclass(frozen=True)
class EncodeItem:
    """One image or video of an EncodeRequest: the repeated field and its fields. Added in place: a built
    ImageInput appended to a request is copied again (upb; common/client.py's fill_image_input)."""

    field: str  # "images" or "videos"
    fields: dict

    def add_to(self, request: encoder_pb2.EncodeRequest) -> None:
        """Append it to request's repeated field, its bytes copied once."""
        getattr(request, self.field).add(**self.fields)


def by_hash(req: EmbeddingRequest) -> EncodeItem:
    """The request's image or video named by its content hash alone."""
    return EncodeItem("videos" if req.video is not None else "images", {"content_hash": req.content_hash})


def with_bytes(req: EmbeddingRequest, timeout: float) -> EncodeItem:
    """The request's image or video with its file (bytes still on their way are waited for up to
    timeout) and the settings its tokens were counted by."""
    video = req.video
    if video is not None:  # the settings come resolved: the encoder hashes it as the decoder did
        data = file_bytes(video.data, timeout)
        return EncodeItem("videos", dict(data=data, fps=video.fps, max_frames=video.max_frames,
                                         min_pixels=video.min_pixels, max_pixels=video.max_pixels))
    fields = {"data": image_bytes(req.image, timeout)}
    if req.pixels is not None:  # the range (Qwen-VL) or crop choice (Gemma 3) the tokens were counted by
        fields.update(req.pixels.input_fields())
    return EncodeItem("images", fields)


def image_bytes(image: bytes | Image.Image | FollowingBytes, timeout: float) -> bytes:
    """The file to send: as given, a PIL image as PNG, or bytes still on their way (waited for)."""
    return encode_png(image) if isinstance(image, Image.Image) else file_bytes(image, timeout)
