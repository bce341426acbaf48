"""DecoderService: streaming Generate over the engine core (its own process), and GetStats.

The front end's share of a request: input processing (validation, image decoding and hashing,
tokenization) in a worker thread, then the engine core's outputs turned into stream messages, with
detokenization here rather than on the core (which detokenizes only requests with stop strings).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from common.errors import InvalidInputError, ServiceError, invalid_argument, resource_exhausted
from common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc
from common.stats import to_message
from decoder_svc.core_client import CoreDeadError, EngineCoreClient
from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.engine.engine import QueueFullError
from decoder_svc.engine.input_processor import InputProcessor
from decoder_svc.engine.output_processor import RequestOutput
from decoder_svc.engine.request import FinishReason
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.metrics import DecoderMetrics

log = logging.getLogger("mmserve.decoder")

SERVICE_NAME = "mmserve.v1.DecoderService"
MAX_REQUEST_ID_BYTES = 256  # the client's id only labels logs
_DRAIN_POLL_S = 0.05
_SHUTTING_DOWN = "decoder shutting down: the drain timeout ended this request"
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


def _image(index: int, image: common_pb2.ImageInput) -> bytes | str:
    kind = image.WhichOneof("source")
    if kind == "data":
        return image.data
    if kind == "content_hash":
        return image.content_hash
    raise invalid_argument(f"image {index}: neither data nor content_hash is set")


def parse_request(request: decoder_pb2.GenerateRequest) -> ParsedRequest:
    """Validate the request's shape and turn it into engine arguments (INVALID_ARGUMENT on misuse)."""
    if len(request.request_id.encode()) > MAX_REQUEST_ID_BYTES:
        raise invalid_argument(f"request_id longer than {MAX_REQUEST_ID_BYTES} bytes")
    s = request.sampling
    sampling = SamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs)
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise invalid_argument("empty prompt")
        images = [_image(i, img) for i, img in enumerate(request.images)]
        return ParsedRequest(request.prompt, None, images, sampling, request.cache_salt)
    if kind == "chat":
        if request.images:
            raise invalid_argument("chat requests carry their images in the messages, not in `images`")
        messages, images = [], []
        for message in request.chat.messages:
            content = []
            for part in message.content:
                if part.WhichOneof("part") == "image":
                    images.append(_image(len(images), part.image))
                    content.append({"type": "image"})
                else:
                    content.append({"type": "text", "text": part.text})
            messages.append({"role": message.role, "content": content})
        if not messages:
            raise invalid_argument("empty chat")
        return ParsedRequest(None, messages, images, sampling, request.cache_salt)
    raise invalid_argument("empty input: set prompt or chat")


class OutputStream:
    """One request's outputs, as the engine core sends them, read one message at a time.

    A read takes every output already queued and merges them, so a client that reads slower than the
    engine steps gets several tokens per message instead of a growing backlog. An error output is
    never merged: it ends the stream on its own read.
    """

    def __init__(self, queue: asyncio.Queue) -> None:
        self._queue = queue
        self._held: RequestOutput | None = None

    async def read(self) -> RequestOutput:
        """The next message's worth of output (waits for at least one)."""
        output, self._held = self._held or await self._queue.get(), None
        while not output.finished and not output.error and not self._queue.empty():
            nxt: RequestOutput = self._queue.get_nowait()
            if nxt.error:
                self._held = nxt
                break
            output = RequestOutput(
                output.request_id, output.new_token_ids + nxt.new_token_ids, output.text + nxt.text,
                output.logprobs + nxt.logprobs, nxt.finish_reason, nxt.usage)
        return output


def _response(output: RequestOutput) -> decoder_pb2.GenerateResponse:
    response = decoder_pb2.GenerateResponse(token_ids=output.new_token_ids, text=output.text)
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


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    """Generate and GetStats over an EngineLoop."""

    def __init__(self, core: EngineCoreClient, inputs: InputProcessor,
                 metrics: DecoderMetrics | None = None) -> None:
        self.core = core
        self.inputs = inputs
        self.metrics = metrics
        self.draining = False

    async def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE) and return once every in-flight stream has ended."""
        self.draining = True
        while self.core.num_open_streams:
            await asyncio.sleep(_DRAIN_POLL_S)

    def end_drain(self) -> None:
        """Time is up: end the streams still open with UNAVAILABLE."""
        self.core.fail_open_streams(_SHUTTING_DOWN)

    async def _add(self, request_id: str, parsed: ParsedRequest) -> None:
        try:
            # Decoding, hashing and tokenizing happen here, in a worker thread of the front end.
            req = await asyncio.to_thread(
                self.inputs.make_request, request_id, parsed.prompt, parsed.images,
                messages=parsed.messages, sampling=parsed.sampling, cache_salt=parsed.cache_salt)
            await self.core.add(req)
        except QueueFullError as exc:
            raise resource_exhausted(str(exc)) from None
        except InvalidInputError as exc:  # InvalidRequestError, PromptError: the client's mistake
            raise invalid_argument(str(exc)) from None
        except CoreDeadError as exc:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"decoder engine unavailable: {exc}") from None

    def _stream_detokenizer(self, sampling: SamplingParams) -> IncrementalDetokenizer | None:
        """The stream's own detokenizer; None when the core detokenizes (requests with stop strings,
        whose stopping needs the text)."""
        if sampling.stop:
            return None
        return IncrementalDetokenizer(self.inputs.tokenizer.tokenizer)

    def _error_status(self, request_id: str, output: RequestOutput) -> ServiceError:
        if output.error == _SHUTTING_DOWN:
            return ServiceError(grpc.StatusCode.UNAVAILABLE, _SHUTTING_DOWN)
        code = grpc.StatusCode[output.error_code] if output.error_code else grpc.StatusCode.INTERNAL
        return ServiceError(code, output.error or "request failed")

    async def Generate(self, request: decoder_pb2.GenerateRequest, context
                       ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        started = time.perf_counter()
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "decoder shutting down: send to another replica")
        parsed = parse_request(request)
        # Internal ids are always unique; the client's id is for logs.
        request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        outputs = OutputStream(self.core.open_stream(request_id))
        added = finished = False
        last = None
        try:
            await self._add(request_id, parsed)
            detok = self._stream_detokenizer(parsed.sampling)
            added = True
            while not finished:
                output = await outputs.read()
                if output.error:
                    finished = True
                    self._count("failed")
                    raise self._error_status(request_id, output)
                finished = output.finished
                if detok is not None:
                    output.text = detok.add(output.new_token_ids) + (detok.finish() if finished else "")
                now = time.perf_counter()
                if self.metrics is not None and output.new_token_ids:
                    (self.metrics.ttft if last is None else self.metrics.itl).observe(
                        now - (started if last is None else last))
                    last = now
                yield _response(output)
            self._count("finished")
            if self.metrics is not None:
                self.metrics.e2e.observe(time.perf_counter() - started)
        finally:
            self.core.close_stream(request_id)
            if not finished:
                self._count("aborted" if added else "rejected")
                # Client cancel, deadline or a failure: free blocks and leases now. Also when the add
                # itself was cancelled midway, since the engine may have queued the request already.
                try:
                    await self.core.abort(request_id)
                except CoreDeadError:
                    pass

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome).inc()

    async def GetStats(self, request: common_pb2.StatsRequest, context) -> decoder_pb2.DecoderStats:
        return to_message(await self.core.stats(), decoder_pb2.DecoderStats)
