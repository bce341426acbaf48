"""Python clients for both services (sync and asyncio), over the generated stubs.

    from common.client import DecoderClient
    with DecoderClient("127.0.0.1:50052") as client:
        result = client.generate_text("USER: <image>\\nWhat is this? ASSISTANT:", images=["cat.png"])
        print(result.text, result.usage)

Every client takes `tls=ClientTls.from_files(ca=..., cert=..., key=...)` for TLS or mutual TLS and
`token=...` for a server started with --auth-tokens (common/security/, docs/security.md).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from common.security.client_auth import token_interceptors
from common.security.tls import ClientTls, open_aio_channel, open_channel
from common.server import DEFAULT_MAX_MESSAGE_BYTES

ImageLike = str | Path | bytes | common_pb2.ImageInput
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
]


def image_input(image: ImageLike) -> common_pb2.ImageInput:
    """An ImageInput from a file path, encoded bytes, a content hash ("hash:<hex>") or an ImageInput."""
    if isinstance(image, common_pb2.ImageInput):
        return image
    return fill_image_input(common_pb2.ImageInput(), image)


def fill_image_input(field: common_pb2.ImageInput, image: ImageLike) -> common_pb2.ImageInput:
    """Fill an ImageInput in place (a repeated field's new element) from anything image_input takes.

    In place because appending a built message to a repeated field copies it again (upb; BENCHMARKS.md
    has the cost for a 3 MB image)."""
    if isinstance(image, common_pb2.ImageInput):
        field.CopyFrom(image)
    elif isinstance(image, bytes):
        field.data = image
    elif str(image).startswith("hash:"):
        field.content_hash = str(image)[len("hash:"):]
    else:
        field.data = Path(str(image)).read_bytes()
    return field


def sampling_params(
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int = 0,
    min_tokens: int = 0,
) -> decoder_pb2.SamplingParams:
    """SamplingParams with API.md's defaults (0 means the server default / off; temperature 0 is greedy)."""
    params = decoder_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=list(stop),
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, logprobs=logprobs,
        min_tokens=min_tokens)
    if seed is not None:
        params.seed = seed
    return params


def generate_request(
    prompt: str | None = None,
    images: Iterable[ImageLike] = (),
    chat: Sequence[dict] | None = None,
    request_id: str | None = None,
    cache_salt: str = "",
    lora_adapter: str = "",
    n: int = 1,
    **sampling,
) -> decoder_pb2.GenerateRequest:
    """Build a GenerateRequest from a prompt with "<image>" markers, or from chat messages.

    chat: [{"role": "user", "content": [{"type": "image", "image": <ImageLike>}, {"type": "text",
    "text": "..."}]}, ...]; a plain string content is one text part. `lora_adapter`: one of the
    decoder's --lora-modules names ("": the base model). `n`: samples of the prompt (each response's
    `index` names its choice; DecoderClient.generate_choices gathers them).
    """
    request = decoder_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex, cache_salt=cache_salt, lora_adapter=lora_adapter,
        sampling=sampling_params(**sampling), n=n if n > 1 else 0)
    if (prompt is None) == (chat is None):
        raise ValueError("give exactly one of prompt or chat")
    if prompt is not None:
        request.prompt = prompt
        for image in images:
            fill_image_input(request.images.add(), image)
        return request
    for message in chat:
        out = request.chat.messages.add(role=message["role"])
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts:
            if part["type"] == "text":
                out.content.add(text=part["text"])
            elif part["type"] == "image":
                fill_image_input(out.content.add().image, part["image"])
            else:
                raise ValueError(f"unknown content part type {part['type']!r}")
    return request


@dataclass
class GenerationResult:
    """A whole generation, gathered from the stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[decoder_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str = "UNSPECIFIED"
    usage: decoder_pb2.Usage | None = None

    def add(self, chunk: decoder_pb2.GenerateResponse) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = decoder_pb2.FinishReason.Name(chunk.finish_reason).removeprefix(
                "FINISH_REASON_")
            self.usage = chunk.usage


class DecoderClient:
    """Blocking client of the decoder service."""

    def __init__(self, address: str, timeout: float | None = None, tls: ClientTls | None = None,
                 token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = open_channel(address, tls, CHANNEL_OPTIONS, token_interceptors(token))
        self.stub = decoder_pb2_grpc.DecoderServiceStub(self._channel)

    def generate(self, prompt: str | None = None, images: Iterable[ImageLike] = (),
                 **kwargs) -> Iterator[decoder_pb2.GenerateResponse]:
        """Stream GenerateResponse chunks; kwargs are generate_request's (chat, sampling fields, ...)."""
        return self.stub.Generate(generate_request(prompt, images, **kwargs), timeout=self.timeout)

    def generate_text(self, prompt: str | None = None, images: Iterable[ImageLike] = (),
                      **kwargs) -> GenerationResult:
        """The whole generation at once."""
        result = GenerationResult()
        for chunk in self.generate(prompt, images, **kwargs):
            result.add(chunk)
        return result

    def generate_choices(self, prompt: str | None = None, images: Iterable[ImageLike] = (), n: int = 1,
                         **kwargs) -> list[GenerationResult]:
        """The n samples of one request (GenerateRequest.n), each gathered from its messages by `index`."""
        results = [GenerationResult() for _ in range(n)]
        for chunk in self.generate(prompt, images, n=n, **kwargs):
            results[chunk.index].add(chunk)
        return results

    def stats(self) -> decoder_pb2.DecoderStats:
        return self.stub.GetStats(common_pb2.StatsRequest(), timeout=self.timeout or 10)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DecoderClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncDecoderClient:
    """asyncio client of the decoder service."""

    def __init__(self, address: str, timeout: float | None = None, tls: ClientTls | None = None,
                 token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = open_aio_channel(address, tls, CHANNEL_OPTIONS, token_interceptors(token, aio=True))
        self.stub = decoder_pb2_grpc.DecoderServiceStub(self._channel)

    async def generate(self, prompt: str | None = None, images: Iterable[ImageLike] = (),
                       **kwargs) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        """Stream GenerateResponse chunks."""
        call = self.stub.Generate(generate_request(prompt, images, **kwargs), timeout=self.timeout)
        async for chunk in call:
            yield chunk

    async def generate_text(self, prompt: str | None = None, images: Iterable[ImageLike] = (),
                            **kwargs) -> GenerationResult:
        result = GenerationResult()
        async for chunk in self.generate(prompt, images, **kwargs):
            result.add(chunk)
        return result

    async def stats(self) -> decoder_pb2.DecoderStats:
        return await self.stub.GetStats(common_pb2.StatsRequest(), timeout=self.timeout or 10)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncDecoderClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def new_lease_owner() -> str:
    """A fresh lease-owner secret (128 random bits, hex): the encoder binds leases to it."""
    return secrets.token_hex(16)


def _encode_request(images: Iterable[ImageLike], accept: Sequence[int], cache_salt: str, prefetch: bool,
                    request_id: str, lease_owner: str) -> encoder_pb2.EncodeRequest:
    request = encoder_pb2.EncodeRequest(request_id=request_id, accept=list(accept), cache_salt=cache_salt,
                                        prefetch=prefetch, lease_owner=lease_owner)
    for image in images:
        fill_image_input(request.images.add(), image)
    return request


class EncoderClient:
    """Blocking client of the encoder service.

    Leases it takes are bound to `lease_owner` (a fresh secret per client unless one is given), so only
    this client, or one given the same owner, can release them.
    """

    def __init__(self, address: str, timeout: float | None = None, lease_owner: str | None = None,
                 tls: ClientTls | None = None, token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.lease_owner = new_lease_owner() if lease_owner is None else lease_owner
        self._channel = open_channel(address, tls, CHANNEL_OPTIONS, token_interceptors(token))
        self.stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    def encode(self, images: Iterable[ImageLike], accept: Sequence[int] = (common_pb2.TRANSPORT_INLINE,),
               cache_salt: str = "", prefetch: bool = False,
               request_id: str = "") -> encoder_pb2.EncodeResponse:
        """One EmbeddingRef per image; release the lease of each non-inline ref when done."""
        return self.stub.Encode(_encode_request(images, accept, cache_salt, prefetch, request_id,
                                                self.lease_owner), timeout=self.timeout)

    def release(self, lease_ids: Iterable[str]) -> int:
        """Release this client's leases; returns how many were live (others' and unknown ids count 0)."""
        return self.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=list(lease_ids),
                                                            lease_owner=self.lease_owner),
                                 timeout=self.timeout).released

    def lookup(self, content_hashes: Iterable[str], cache_salt: str = "") -> list[bool]:
        """Whether each hash is cached under cache_salt."""
        return list(self.stub.Lookup(encoder_pb2.LookupRequest(
            content_hashes=list(content_hashes), cache_salt=cache_salt), timeout=self.timeout).cached)

    def stats(self) -> encoder_pb2.EncoderStats:
        return self.stub.GetStats(common_pb2.StatsRequest(), timeout=self.timeout or 10)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncEncoderClient:
    """asyncio client of the encoder service; leases are bound to `lease_owner` as in EncoderClient."""

    def __init__(self, address: str, timeout: float | None = None, lease_owner: str | None = None,
                 tls: ClientTls | None = None, token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self.lease_owner = new_lease_owner() if lease_owner is None else lease_owner
        self._channel = open_aio_channel(address, tls, CHANNEL_OPTIONS, token_interceptors(token, aio=True))
        self.stub = encoder_pb2_grpc.EncoderServiceStub(self._channel)

    async def encode(self, images: Iterable[ImageLike],
                     accept: Sequence[int] = (common_pb2.TRANSPORT_INLINE,), cache_salt: str = "",
                     prefetch: bool = False, request_id: str = "") -> encoder_pb2.EncodeResponse:
        """One EmbeddingRef per image; release the lease of each non-inline ref when done."""
        return await self.stub.Encode(_encode_request(images, accept, cache_salt, prefetch, request_id,
                                                      self.lease_owner), timeout=self.timeout)

    async def release(self, lease_ids: Iterable[str]) -> int:
        """Release this client's leases; returns how many were live (others' and unknown ids count 0)."""
        reply = await self.stub.Release(encoder_pb2.ReleaseRequest(lease_ids=list(lease_ids),
                                                                   lease_owner=self.lease_owner),
                                        timeout=self.timeout)
        return reply.released

    async def lookup(self, content_hashes: Iterable[str], cache_salt: str = "") -> list[bool]:
        """Whether each hash is cached under cache_salt."""
        reply = await self.stub.Lookup(encoder_pb2.LookupRequest(
            content_hashes=list(content_hashes), cache_salt=cache_salt), timeout=self.timeout)
        return list(reply.cached)

    async def stats(self) -> encoder_pb2.EncoderStats:
        return await self.stub.GetStats(common_pb2.StatsRequest(), timeout=self.timeout or 10)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
