"""DecoderService: streaming Generate over the engine core (its own process), and GetStats.

The front end's share of a request: the message's shape (wire.py), input processing (validation, image
decoding and hashing, tokenization: engine/input_processor.py) in a worker thread, then the engine
core's outputs as stream messages (stream.py), detokenized here rather than on the core (which
detokenizes only requests with stop strings).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

import grpc

from common.errors import CapacityError, InvalidInputError, ServiceError, as_service_error
from common.memo import BoundedMemo
from common.memory_return import MemoryReturn
from common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc
from common.stage_totals import StageTotals
from common.stats import to_message
from decoder_svc.core_client import CoreDeadError, EngineCoreClient
from decoder_svc.encoders.front_link import FileAhead, FrontEndLink, file_ahead
from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.engine.input_processor import InputProcessor
from decoder_svc.engine.output_processor import RequestOutput
from decoder_svc.engine.request import Request
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.ttft_stages import STAGES, FirstTokenStats, split_ttft
from decoder_svc.input_lanes import InputLanes
from decoder_svc.metrics import DecoderMetrics
from decoder_svc.stats import DecoderStats
from decoder_svc.stream import OutputStream
from decoder_svc.wire import ParsedRequest, parse_request, to_response

log = logging.getLogger("mmserve.decoder")

SERVICE_NAME = "mmserve.v1.DecoderService"
_DRAIN_POLL_S = 0.05
MAX_SENT_AHEAD = 65536  # (salt, content hash) of files sent ahead, remembered so a repeat is not resent
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry-throttling trailer: retry after this many ms
DRAIN_RETRY_AFTER_MS = 1000  # another replica can take it at once; this one will not come back
_SHUTTING_DOWN = "decoder shutting down: the drain timeout ended this request"
# A request with this many bytes of image and video files counts toward giving memory back.
_HEAVY_REQUEST_BYTES = 64 << 10


class DecoderServicer(decoder_pb2_grpc.DecoderServiceServicer):
    """Generate and GetStats over the engine core (core_client.EngineCoreClient)."""

    def __init__(self, core: EngineCoreClient, inputs: InputProcessor,
                 metrics: DecoderMetrics | None = None, lanes: InputLanes | None = None,
                 encoders: FrontEndLink | None = None, send_ahead: bool = True) -> None:
        self.core = core
        self.inputs = inputs
        self.metrics = metrics
        self.lanes = lanes or InputLanes()
        self.encoders = encoders  # grids of hash-only Qwen-VL images; new files sent ahead
        self.send_ahead = send_ahead and encoders is not None
        self._sent_ahead: BoundedMemo[bool] = BoundedMemo(MAX_SENT_AHEAD)  # (salt, hash) sent recently
        # Files go ahead only while few requests await their first token: behind a backlog the engine's
        # lookahead asks for them in queue order, so the tower's work stays just ahead of the prefills
        # that need it instead of every arrival's image competing for the GPU with them.
        self.awaiting_first_token = 0
        self.send_ahead_depth = max(1, inputs.config.encoder_max_ahead)
        self.draining = False
        self.ttft_totals = StageTotals(STAGES)  # where time to first token goes (engine/ttft_stages.py)
        # Requests' files (7 MB data URLs, copied by gRPC, parsing and the lanes) leave free memory in
        # glibc's arenas and, from failed requests, in reference cycles: given back once enough went by.
        self.memory = MemoryReturn()
        self.heavy_open = 0  # requests of _HEAVY_REQUEST_BYTES or more in flight

    async def _known_grids(self, parsed: ParsedRequest) -> dict | None:
        """Grids of the request's hash-only images this front end has not hashed itself (where the layout
        sizes images, their token counts), from the encoders that hold them."""
        # Sized images: every image of a sized layout; Gemma 3's hashed with crops (per request or not).
        layout = self.inputs.layout
        if self.encoders is None or not (layout.sized_by_image or layout.per_image_crops):
            return None
        missing = [i for i in parsed.images
                   if isinstance(i, str) and self.inputs.known_grid(parsed.cache_salt, i) is None]
        if not missing:
            return None
        return await asyncio.to_thread(self.encoders.lookup, missing, parsed.cache_salt)

    async def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE) and return once every in-flight stream has ended."""
        self.draining = True
        while self.core.num_open_streams:
            await asyncio.sleep(_DRAIN_POLL_S)

    def end_drain(self) -> None:
        """Time is up: end the streams still open with UNAVAILABLE."""
        self.core.fail_open_streams(_SHUTTING_DOWN)

    async def _add(self, request_id: str, parsed: ParsedRequest, received: float) -> None:
        try:
            # Decoding, hashing and tokenizing happen here, in a worker thread of the front end: text-only
            # requests in a lane of their own, so that image work never holds them up (input_lanes.py).
            known = await self._known_grids(parsed)
            req = await self.lanes.run(len(parsed.images) + len(parsed.videos), self.inputs.make,
                                       parsed.new_request(request_id, known))
            req.times.received, req.times.made = received, time.monotonic()
            self._send_files_ahead(req)
            await self.core.add(req)
        except CoreDeadError as exc:
            raise as_service_error(exc, "decoder engine unavailable: ") from None
        except (CapacityError, InvalidInputError) as exc:  # queue or input lanes full; the client's mistake
            raise as_service_error(exc) from None

    def _send_files_ahead(self, req: Request) -> None:
        """A file this front end has not sent lately (an image's, a video's) goes to its encoder now, in
        the background (encoders/front_link.py), as demand work; its placeholders say so, and the engine
        asks for it by hash only, waiting briefly if the encoder has not received it yet. Not while more
        than `send_ahead_depth` requests (this one included) await their first token: the file then
        follows its request and the engine asks for it with its bytes, in queue order (lookahead)."""
        if not self.send_ahead or self.awaiting_first_token > self.send_ahead_depth:
            return
        files: dict[str, FileAhead] = {}  # by content hash: a video's placeholders (Qwen3-VL) share one
        for img in req.images:
            h = img.content_hash
            if h not in files:
                file = file_ahead(img)
                key = (req.cache_salt, h)
                if file is None or self._sent_ahead.get(key) is not None:
                    continue
                self._sent_ahead.put(key, True)
                files[h] = file
            img.sent_ahead = True
        if files:  # serialising megabytes is not the event loop's work
            asyncio.get_running_loop().run_in_executor(None, self.encoders.send_ahead, list(files.values()),
                                                       req.cache_salt)

    def _stream_detokenizer(self, sampling: SamplingParams) -> Callable[[], IncrementalDetokenizer] | None:
        """The stream's own detokenizers (one per choice); None when the core detokenizes (requests with
        stop strings, whose stopping needs the text)."""
        if sampling.stop:
            return None
        return partial(IncrementalDetokenizer, self.inputs.tokenizer.tokenizer)

    def _error_status(self, request_id: str, output: RequestOutput) -> ServiceError:
        if output.error == _SHUTTING_DOWN:
            return ServiceError(grpc.StatusCode.UNAVAILABLE, _SHUTTING_DOWN)
        code = grpc.StatusCode[output.error_code] if output.error_code else grpc.StatusCode.INTERNAL
        return ServiceError(code, output.error or "request failed")

    async def Generate(self, request: decoder_pb2.GenerateRequest, context
                       ) -> AsyncIterator[decoder_pb2.GenerateResponse]:
        started, received = time.perf_counter(), time.monotonic()
        if self.draining:  # retry info for gRPC clients: gRPC's pushback, in the trailers
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(DRAIN_RETRY_AFTER_MS)),))
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "decoder shutting down: send to another replica")
        parsed = parse_request(request)
        # Internal ids are always unique; the client's id is for logs.
        request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        outputs = OutputStream(self.core.open_stream(request_id), self._stream_detokenizer(parsed.sampling))
        added = finished = False
        open_choices = parsed.n  # the stream ends after every choice's last message
        last = None
        awaiting = True  # counted in awaiting_first_token until its first output
        self.awaiting_first_token += 1
        nbytes = parsed.file_bytes
        heavy = nbytes >= _HEAVY_REQUEST_BYTES
        self.heavy_open += heavy
        try:
            await self._add(request_id, parsed, received)
            added = True
            while not finished:
                output = await outputs.read()
                if awaiting:
                    awaiting = False
                    self.awaiting_first_token -= 1
                if output.error:
                    finished = True
                    self._count("failed")
                    raise self._error_status(request_id, output)
                open_choices -= output.finished
                finished = open_choices == 0
                if output.times is not None:
                    self._observe_ttft_split(split_ttft(output.times, time.monotonic()))
                now = time.perf_counter()
                if self.metrics is not None and output.new_token_ids and output.index == 0:  # a step once
                    (self.metrics.ttft if last is None else self.metrics.itl).observe(
                        now - (started if last is None else last))
                    last = now
                yield to_response(output)
            self._count("finished")
            if self.metrics is not None:
                self.metrics.e2e.observe(time.perf_counter() - started)
        finally:
            if awaiting:
                self.awaiting_first_token -= 1
            if heavy:
                self.heavy_open -= 1
                self.memory.freed(nbytes, idle=self.heavy_open == 0)
            self.core.close_stream(request_id)
            if not finished:
                self._count("aborted" if added else "rejected")
                # Client cancel, deadline or a failure: free blocks and leases now. Also when the add
                # itself was cancelled midway, since the engine may have queued the request already.
                try:
                    await self.core.abort(request_id)
                except CoreDeadError:
                    pass

    def _observe_ttft_split(self, split: dict[str, float]) -> None:
        self.ttft_totals.add(split)
        if self.metrics is not None:
            self.metrics.observe_ttft_stages(split)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome).inc()

    async def stats(self) -> DecoderStats:
        """The service's stats record: the core's, with the front end's TTFT split."""
        record = await self.core.stats()
        record.first_token = FirstTokenStats(*self.ttft_totals.snapshot())
        return record

    async def GetStats(self, request: common_pb2.StatsRequest, context) -> decoder_pb2.DecoderStats:
        return to_message(await self.stats(), decoder_pb2.DecoderStats)
