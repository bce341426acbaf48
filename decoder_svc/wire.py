"""The decoder's API messages in the engine's terms, and back: a GenerateRequest becomes engine arguments
(its shape checked, INVALID_ARGUMENT on misuse), a RequestOutput becomes a GenerateResponse."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from common.errors import invalid_argument
from common.image_geometry import Grid
from common.pb import common_pb2, decoder_pb2
from decoder_svc.engine.embedding_source import VideoSource
from decoder_svc.engine.new_request import ImageOptions, NewRequest
from decoder_svc.engine.output_processor import RequestOutput
from decoder_svc.engine.request import FinishReason
from decoder_svc.engine.sampling_params import SamplingParams

MAX_REQUEST_ID_BYTES = 256  # the client's id only labels logs
_FINISH = {FinishReason.STOP: decoder_pb2.FINISH_REASON_STOP,
           FinishReason.LENGTH: decoder_pb2.FINISH_REASON_LENGTH,
           FinishReason.ABORT: decoder_pb2.FINISH_REASON_ABORT}


@dataclass
class ParsedRequest:
    """A GenerateRequest in the engine's terms."""

    prompt: str | None
    messages: list[dict] | None
    images: list[bytes | str]  # encoded file, or a content hash
    sampling: SamplingParams
    cache_salt: str
    image_options: list[ImageOptions] = field(default_factory=list)  # per image (pixels, pan-and-scan)
    videos: list[VideoSource] = field(default_factory=list)  # Qwen-VL videos, in prompt order
    prompt_token_ids: list[int] | None = None  # a prompt given as token ids (text only)
    lora_adapter: str = ""  # a --lora-modules name ("": the base model); the engine checks it
    n: int = 1  # samples of the prompt (0 on the wire means 1); the engine checks the bound

    @property
    def file_bytes(self) -> int:
        """Bytes of the images' and videos' files it carries (what makes a request heavy), counted from the
        parsed fields (the message's ByteSize would walk and size every field again)."""
        return (sum(len(image) for image in self.images if isinstance(image, bytes))
                + sum(len(video.data) for video in self.videos if isinstance(video.data, bytes)))

    def new_request(self, request_id: str, known_grids: Mapping[str, Grid] | None = None) -> NewRequest:
        """The engine's input for it, named request_id; known_grids: grids of its hash-only images."""
        return NewRequest(request_id, self.prompt, self.images, messages=self.messages,
                          sampling=self.sampling, cache_salt=self.cache_salt,
                          image_options=self.image_options, known_grids=known_grids, videos=self.videos,
                          prompt_token_ids=self.prompt_token_ids, lora_adapter=self.lora_adapter, n=self.n)


def _image(index: int, image: common_pb2.ImageInput) -> bytes | str:
    kind = image.WhichOneof("source")
    if kind == "data":
        return image.data
    if kind == "content_hash":
        return image.content_hash
    raise invalid_argument(f"image {index}: neither data nor content_hash is set")


def _options(image: common_pb2.ImageInput) -> ImageOptions:
    """An image's processor options: its pixel range, and its pan_and_scan where set (None: unset)."""
    pan_and_scan = image.pan_and_scan if image.HasField("pan_and_scan") else None
    return ImageOptions(image.min_pixels, image.max_pixels, pan_and_scan)


def _video(index: int, video: common_pb2.VideoInput) -> VideoSource:
    kind = video.WhichOneof("source")
    if kind not in ("data", "content_hash"):
        raise invalid_argument(f"video {index}: neither data nor content_hash is set")
    # A hash-only video reaches the engine without bytes, which refuses it with a clear message.
    return VideoSource(video.data if kind == "data" else None, video.fps, video.max_frames, video.min_pixels,
                       video.max_pixels)


def parse_request(request: decoder_pb2.GenerateRequest) -> ParsedRequest:
    """Validate the request's shape and turn it into engine arguments (INVALID_ARGUMENT on misuse)."""
    if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise invalid_argument(f"request_id longer than {MAX_REQUEST_ID_BYTES} bytes")
    s = request.sampling
    sampling = SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs, min_tokens=s.min_tokens)
    parsed = _parse_input(request, sampling)
    parsed.lora_adapter = request.lora_adapter
    parsed.n = max(request.n, 1)
    return parsed


def _parse_input(request: decoder_pb2.GenerateRequest, sampling: SamplingParams) -> ParsedRequest:
    """The request's input (prompt, chat or token ids) with its images and videos."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise invalid_argument("empty prompt")
        images = [_image(i, img) for i, img in enumerate(request.images)]
        options = [_options(img) for img in request.images]
        videos = [_video(i, v) for i, v in enumerate(request.videos)]
        return ParsedRequest(request.prompt, None, images, sampling, request.cache_salt, options, videos)
    if kind == "chat":
        if request.images or request.videos:
            raise invalid_argument("chat requests carry their images and videos in the messages, not in "
                                   "`images`/`videos`")
        messages, images, options, videos = [], [], [], []
        for message in request.chat.messages:
            content = []
            for part in message.content:
                kind = part.WhichOneof("part")
                if kind == "image":
                    images.append(_image(len(images), part.image))
                    options.append(_options(part.image))
                    content.append({"type": "image"})
                elif kind == "video":
                    videos.append(_video(len(videos), part.video))
                    content.append({"type": "video"})
                else:
                    content.append({"type": "text", "text": part.text})
            messages.append({"role": message.role, "content": content})
        if not messages:
            raise invalid_argument("empty chat")
        return ParsedRequest(None, messages, images, sampling, request.cache_salt, options, videos)
    if kind == "prompt_token_ids":
        if request.images or request.videos:
            raise invalid_argument("a token-id prompt takes no images or videos: send a text prompt or chat")
        return ParsedRequest(None, None, [], sampling, request.cache_salt,
                             prompt_token_ids=list(request.prompt_token_ids.ids))
    raise invalid_argument("empty input: set prompt, chat or prompt_token_ids")


def to_response(output: RequestOutput) -> decoder_pb2.GenerateResponse:
    """One stream message."""
    response = decoder_pb2.GenerateResponse(token_ids=output.new_token_ids, text=output.text,
                                            index=output.index)
    for lp in output.logprobs:
        response.logprobs.add(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
    if output.finish_reason is not None:
        response.finish_reason = _FINISH.get(output.finish_reason, decoder_pb2.FINISH_REASON_UNSPECIFIED)
    if output.usage is not None:
        u = output.usage
        response.usage.CopyFrom(decoder_pb2.Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
            cached_prompt_tokens=u.cached_prompt_tokens, images=u.images,
            images_encoder_cache_hits=u.images_encoder_cache_hits,
            images_skipped_by_kv_reuse=u.images_skipped_by_kv_reuse))
    return response
