"""EncoderService: Encode, Prefetch, Release, Lookup and GetStats over the cache and vision worker.

The servicer never runs vision work on the event loop: images are decoded and hashed in a pool of
worker processes (encoder_svc/decode_pool.py; in a thread with `decode_processes=0`), tower work is
queued to the vision worker, and the RPC awaits the cache's futures. Every lease a failing request
took is released before the error goes out, so errors never pin cache memory.

Tenant isolation (see encoder_svc/cache.py): a hash-only image resolves only under the cache_salt its
entry was made with, else NOT_FOUND exactly as for an unknown hash (Lookup answers false, Prefetch
skips it); leases belong to the request's lease_owner and Release frees only the caller's own.

An embedding travels as one EmbeddingRef whatever its shape: [rows, hidden] (LLaVA, Qwen2.5-VL, Gemma 3,
Phi-4-MM) or [parts, rows, hidden] (Qwen3-VL's merged features and DeepStack levels: one entry, lease and
location). Where the rows follow the image's size (Qwen-VL's pixel range, Phi-4-MM's crops) every image's
size is checked against the model before any image of the request is queued (VisionEncoder.image_nbytes,
common/families/encoder.py), and its grid is kept with its entry for hash-only asks.

Videos (Qwen2.5-VL, Qwen3-VL; encoder_svc/videos.py) follow the images of a request: their settings and
headers are checked against the caps (VideoLimits) and their content hash made from the bytes, in a
thread, before anything is decoded; a miss is decoded and patched on the video lane (video_lane.py:
threads of its own) and run through the tower with its (t, h, w) grid; each video is one cache entry
whose ref also carries its timing. Refs list the images first, then the videos.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import logging
import time

import torch
from prometheus_client import REGISTRY, CollectorRegistry

from common.checkpoint import parse_dtype
from common.errors import ServiceError, as_service_error, invalid_argument, not_found, unavailable
from common.families.encoder import VisionEncoder
from common.hashing import check_cache_salt, hash_image_file, is_content_hash
from common.image_geometry import ImageGeometryError, ImageSettings, hash_fingerprint
from common.images import ImageError, ImageLimits
from common.pb import common_pb2, encoder_pb2, encoder_pb2_grpc
from common.stage_totals import StageTotals
from common.stats import to_message
from common.transport.arena_factory import make_arena
from common.transport.nixl import NixlExporter, make_exporter
from common.video.limits import VideoLimits
from common.vision.attention import use_fixed_choices
from common.vision.encoders import make_vision_encoder
from encoder_svc.cache import CacheFullError, EmbeddingCache, EntryKindError, Handle, SaltClashError
from encoder_svc.config import EncoderConfig
from encoder_svc.decode_pool import DecodePool, DecodeWorkerDied
from encoder_svc.decoded_image import DecodedImage, decode_and_hash
from encoder_svc.defaults import default_decode_processes
from encoder_svc.future_bridge import FutureBridge
from encoder_svc.image_cost import ImageCostCap
from encoder_svc.memory_return import EncodeBytes
from encoder_svc.metrics import EncoderMetrics
from encoder_svc.pending_files import PendingFiles
from encoder_svc.refs import (
    build_ref,
    choose_transport,
    grid_message,
    inline_payload,
    served_transports,
    transport_names,
)
from encoder_svc.stages import STAGES, split_encode
from encoder_svc.stats import EncoderStats, device_memory
from encoder_svc.video_lane import VideoLane
from encoder_svc.videos import VideoJob, plan_videos, video_file_key
from encoder_svc.worker import DEMAND, PREFETCH, VisionWorker

log = logging.getLogger("mmserve.encoder")

SERVICE_NAME = "mmserve.v1.EncoderService"
MAX_LEASE_OWNER_CHARS = 256  # it is stored with every lease: keep it small
_HASH_IN_THREAD_BYTES = 256 << 10  # files this large are hashed off the event loop
_PENDING_WAIT_S = 30.0  # a hash-only ask waits this long at most for a file being decoded here
_MAX_AWAIT_FILE_MS = 1000  # and this long at most for a file sent ahead to arrive (EncodeRequest)


def _release_images(items) -> None:
    """Give back the pixel slots of decoded images (key, image or None) that no worker will read."""
    for item in items:
        if item is not None and item[1] is not None and hasattr(item[1], "release"):
            item[1].release()


def _release_when_done(cache: EmbeddingCache, fut: cf.Future, owner: str) -> None:
    """A request gave up on fut: drop the lease it will carry (taken for owner), now or when it resolves.
    A pending fut is cancelled: its production stops once no request waits for it (video_lane.py)."""
    fut.cancel()

    def _drop(f: cf.Future) -> None:
        if not f.cancelled() and f.exception() is None and f.result().lease_id:
            cache.release([f.result().lease_id], owner)

    fut.add_done_callback(_drop)


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    """The EncoderService RPCs over one vision runner, cache and worker."""

    def __init__(self, vision: VisionEncoder, cache: EmbeddingCache, worker: VisionWorker,
                 limits: ImageLimits = ImageLimits(), registry: CollectorRegistry | None = REGISTRY,
                 decode_pool: DecodePool | None = None, video_limits: VideoLimits = VideoLimits(),
                 nixl: NixlExporter | None = None) -> None:
        self.vision = vision
        self.video_limits = video_limits
        self.video_config = vision.video_config  # None: the model takes no video
        self.decode_pool = decode_pool  # None: decode and hash in a thread
        self._decoding = 0  # Encodes decoding image bytes now (on the event loop: no lock)
        self.pool_decode_always = False  # EncoderConfig.pool_decode_always
        self.cache = cache
        self.worker = worker
        # Videos decode apart from images' threads; a tower that patches on its GPU gets their frames.
        self.video_lane = VideoLane(cache, worker.submit,
                                    patch_on_device=vision.patches_videos_on_device)
        self.limits = limits
        self.nixl = nixl  # the arena registered with a NIXL agent (--nixl), or None
        self.served = served_transports(cache.arena, nixl)
        self.metrics = EncoderMetrics(self.stats, registry)
        self.prefetches = 0
        # Set by build() from --max-image-seconds; off for a servicer made otherwise.
        self.cost_cap = ImageCostCap(0.0, lambda: (worker.busy_s, cache.bytes_made))
        self.pending = PendingFiles()  # files being decoded: hash-only asks wait for them (pending_files.py)
        self.stage_totals = StageTotals(STAGES)  # where Encodes' time goes (encoder_svc/stages.py)
        self._closing = False
        self._future_bridge: FutureBridge | None = None
        self.encode_bytes = EncodeBytes()  # requests' bytes, given back after bursts (memory_return.py)

    @property
    def closing(self) -> bool:
        """True once close() has begun."""
        return self._closing

    @classmethod
    def build(cls, config: EncoderConfig, registry: CollectorRegistry | None = REGISTRY) -> EncoderServicer:
        """Load the vision tower and make the arena, cache and worker for config."""
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if config.deterministic:
            use_fixed_choices()  # before the warm-up's first forward times anything
        vision = make_vision_encoder(config.model, device, parse_dtype(config.dtype), config.preprocess)
        vision.quantize(config.vision_quantization)  # before the graphs capture its layers
        if not config.enforce_eager:
            vision.capture_graphs(config.max_batch_images)  # before any other thread uses the GPU
        if vision.embedding_nbytes > config.cache_bytes:
            raise ValueError(f"--cache-bytes {config.cache_bytes} cannot hold one image's embedding "
                             f"({vision.embedding_nbytes} bytes)")
        arena = make_arena(config.arena, config.cache_bytes, device)
        cache = EmbeddingCache(arena, config.lease_ttl_s, sent_ahead_claim_s=config.sent_ahead_claim_s)
        nixl = make_exporter(arena) if config.nixl else None
        worker = VisionWorker(vision, cache, config.max_batch_images, config.preprocess_threads,
                              batch_invariant=config.deterministic)
        processes = default_decode_processes() if config.decode_processes is None else config.decode_processes
        decode_pool = DecodePool(processes, config.limits) if processes > 0 else None
        servicer = cls(vision, cache, worker, config.limits, registry, decode_pool, config.video_limits, nixl)
        servicer.cost_cap.max_seconds = config.max_image_seconds
        servicer.pool_decode_always = config.pool_decode_always
        return servicer

    # -- helpers -----------------------------------------------------------------------------------

    def _bridge(self) -> FutureBridge:
        """The bridge to the running loop (made on first use: the servicer is built off the loop)."""
        loop = asyncio.get_running_loop()
        if self._future_bridge is None or self._future_bridge.loop is not loop:
            self._future_bridge = FutureBridge(loop)
        return self._future_bridge

    def _check_open(self) -> None:
        if self._closing:
            raise unavailable("encoder is shutting down")

    def _check_count(self, images, videos=()) -> None:
        if not images and not videos:
            raise invalid_argument("no images or videos in the request")
        if len(images) > self.limits.max_images_per_request:
            raise invalid_argument(f"{len(images)} images in one request; the limit is "
                                   f"{self.limits.max_images_per_request}")
        if videos and self.video_config is None:
            raise invalid_argument("this model takes no video input (video 0)")
        if len(videos) > self.video_limits.max_per_request:
            raise invalid_argument(f"{len(videos)} videos in one request; the limit is "
                                   f"{self.video_limits.max_per_request}")

    @staticmethod
    def _check_owner(owner: str) -> None:
        if len(owner) > MAX_LEASE_OWNER_CHARS:
            raise invalid_argument(f"lease_owner is {len(owner)} characters; the limit is "
                                   f"{MAX_LEASE_OWNER_CHARS}")

    @staticmethod
    def _check_salt(salt: str) -> None:
        problem = check_cache_salt(salt)
        if problem is not None:
            raise invalid_argument(problem)

    @staticmethod
    def _hash_only(index: int, item) -> str:
        """The checked content hash of an input without bytes."""
        kind = item.WhichOneof("source")
        if kind != "content_hash":
            raise invalid_argument(f"image {index}: neither data nor content_hash is set")
        text = item.content_hash.lower()
        if not is_content_hash(text):
            raise invalid_argument(f"image {index}: content_hash is not a 64-digit hex digest")
        return text

    async def _register_files(self, request, salt: str) -> list:
        """Register the request's image and video files as pending under their content hashes (the hash
        of their bytes and settings, taken in a thread for large files), before any decoding; returns
        what `pending.end` takes. An input refused later (a bad pixel range, say) just registers nothing
        useful for a while."""
        images = [(i, item) for i, item in enumerate(request.images) if item.WhichOneof("source") == "data"]
        videos = [video for video in request.videos if video.WhichOneof("source") == "data"]
        if not images and not videos:
            return []

        def keys() -> list:
            out = []
            for i, item in images:
                try:
                    out.append((salt, hash_image_file(item.data, self._fingerprint(i, item), salt)))
                except ServiceError:  # a bad pixel range: refused when the input is read
                    continue
            fingerprint = self.vision.fingerprint
            for video in videos:
                key = video_file_key(video, self.video_config, self.video_limits, fingerprint, salt)
                if key is not None:
                    out.append((salt, key))
            return out

        size = sum(len(item.data) for _, item in images) + sum(len(video.data) for video in videos)
        return self.pending.begin(await asyncio.to_thread(keys) if size >= _HASH_IN_THREAD_BYTES else keys())

    async def _registered_inputs(self, request, salt: str) -> tuple[list, list, list]:
        """_inputs with the request's files registered as pending first: (what `pending.end` takes once
        their entries exist, images, videos); a failure ends the registration itself."""
        pending = await self._register_files(request, salt)
        try:
            items, videos = await self._inputs(request, salt)
        except BaseException:
            self.pending.end(pending)
            raise
        return pending, items, videos

    async def _await_pending(self, inputs, salt: str, await_file_ms: int = 0) -> None:
        """A hash-only image or video whose file is being decoded here waits until its entry exists; one
        whose file the caller sent ahead (await_file_ms) but that is neither here nor cached first waits
        for the file to arrive, bounded."""
        keys = [(salt, item.content_hash.lower()) for item in inputs
                if item.WhichOneof("source") == "content_hash"]
        if keys and await_file_ms:
            absent = [k for k in keys if not (self.pending.is_pending(k) or self.cache.known(k[1], k[0]))]
            if absent:
                await self.pending.wait_arrival(absent, min(await_file_ms, _MAX_AWAIT_FILE_MS) / 1000)
        if keys and len(self.pending):
            await self.pending.wait(keys, _PENDING_WAIT_S)

    def _pixels(self, index: int, item) -> ImageSettings | None:
        """An image's settings from its ImageInput: a Qwen-VL image's pixel range (its min/max_pixels
        within the model's), a Gemma 3 image's crop choice (its pan_and_scan, else the checkpoint's); None
        for LLaVA. pan_and_scan true on a model without crops is INVALID_ARGUMENT naming the image."""
        pan_and_scan = item.pan_and_scan if item.HasField("pan_and_scan") else None
        try:
            return self.vision.image_settings(item.min_pixels, item.max_pixels, pan_and_scan)
        except ImageGeometryError as exc:
            raise invalid_argument(f"image {index}: {exc}") from None

    def _fingerprint(self, index: int, item) -> str:
        return hash_fingerprint(self.vision.fingerprint, self._pixels(index, item))

    def _decode_all(self, images, salt: str) -> list[tuple[str, DecodedImage | None]]:
        """(content hash, decoded image or None for hash-only inputs) per input; runs in a thread."""
        out: list[tuple[str, DecodedImage | None]] = []
        for i, item in enumerate(images):
            if item.WhichOneof("source") != "data":
                out.append((self._hash_only(i, item), None))
                continue
            try:
                decoded = decode_and_hash(item.data, self.limits, self._fingerprint(i, item), salt)
            except ImageError as exc:
                raise self._map_error(i, exc) from None
            out.append((decoded.content_hash, decoded))
        return out

    async def _decode_in_pool(self, images, salt: str) -> list[tuple[str, DecodedImage | None]]:
        """_decode_all with every image's bytes decoded and hashed in the pool, all at once."""
        out: list[tuple[str, DecodedImage | None] | None] = [None] * len(images)
        data: dict[int, tuple[bytes, str]] = {}
        for i, item in enumerate(images):  # every input checked before any work starts
            if item.WhichOneof("source") == "data":
                data[i] = (item.data, self._fingerprint(i, item))
            else:
                out[i] = (self._hash_only(i, item), None)
        # One image (the usual request) is awaited in place: a task per image costs the loop more.
        # Pixels stay in the pool's slots until the vision worker has read them (see _acquire).
        decode = functools.partial(self.decode_pool.decode, salt=salt, in_slot=True)
        tasks = {i: (decode(d, fingerprint=fp) if len(data) == 1
                     else asyncio.ensure_future(decode(d, fingerprint=fp)))
                 for i, (d, fp) in data.items()}
        try:
            for i, task in tasks.items():
                try:
                    decoded = await task
                except (ImageError, DecodeWorkerDied) as exc:
                    raise self._map_error(i, exc) from None
                out[i] = (decoded.content_hash, decoded)
        except BaseException:
            _release_images(out)
            raise
        finally:
            for task in tasks.values():  # an earlier image failed (or the RPC was cancelled)
                if isinstance(task, asyncio.Future):
                    task.cancel()
                else:
                    task.close()  # a coroutine never awaited (its RPC failed first): no warning
        return out

    async def _videos(self, videos, salt: str) -> list[tuple[str, VideoJob | None]]:
        """Each video's content hash and, for bytes, its job: settings and header checked and the bytes
        hashed in a thread (nothing decoded); hash-only requests are checked in place."""
        if not videos:
            return []
        args = (videos, self.video_config, self.video_limits, self.vision.fingerprint, salt)
        if all(v.WhichOneof("source") == "content_hash" for v in videos):
            return plan_videos(*args)
        return await asyncio.to_thread(plan_videos, *args)

    async def _inputs(self, request, salt: str) -> tuple[list, list[tuple[str, VideoJob | None]]]:
        """_items of the images and _videos of the videos; a failing video gives back the images' pixel
        slots."""
        items = await self._items(request.images, salt)
        try:
            return items, await self._videos(request.videos, salt)
        except BaseException:
            _release_images(items)
            raise

    async def _items(self, images, salt: str) -> list[tuple[str, DecodedImage | None]]:
        """Each input's content hash and decoded image: decoded in the pool (or a thread) when there are
        bytes; hash-only requests (the decoders' hit path) are checked in place, without a hop."""
        if all(item.WhichOneof("source") == "content_hash" for item in images):
            return self._decode_all(images, salt)
        # The pool's processes keep decoding off the server's interpreter under load, but the hop costs
        # one image alone about as much as its decode (H200 host, 1024x1024 PNG: 25 ms in the pool, 12 ms
        # in a thread; BENCHMARKS.md): the only request decoding right now decodes in a thread.
        alone = self._decoding == 0 and not self.pool_decode_always
        self._decoding += 1
        try:
            if self.decode_pool is not None and not alone:
                return await self._decode_in_pool(images, salt)
            return await asyncio.to_thread(self._decode_all, images, salt)
        finally:
            self._decoding -= 1

    def _check_geometry(self, items, inputs, salt: str) -> None:
        """INVALID_ARGUMENT naming the first decoded image whose size the model cannot take (a Phi-4-MM
        image too thin for its crops, a grid past the cache) or whose estimated tower time is over
        --max-image-seconds, before any image of the request is queued."""
        for i, (key, image) in enumerate(items):
            if image is None:
                continue
            try:
                nbytes = self.vision.image_nbytes(image.height, image.width, self._pixels(i, inputs[i]))
            except ImageGeometryError as exc:
                raise self._map_error(i, exc) from None
            if not self.cache.known(key, salt):  # a hit, or joining a production, costs no tower time
                self.cost_cap.check(i, image.height, image.width, nbytes)

    def _acquire(self, index: int, key: str, image, want_lease: bool, priority: int, salt: str,
                 owner: str = "", pixels: ImageSettings | None = None, for_ask: bool = False) -> cf.Future:
        """The cache's future for key; a miss goes to the vision worker with image, which then owns (and
        releases) the image's pixel slot. Any other outcome releases it here. for_ask: see
        EmbeddingCache.acquire."""
        try:
            # A hash-only image (image None) never produces: it finds an entry of its own salt or none.
            nbytes = self.vision.embedding_nbytes
            if image is not None:  # Qwen-VL, Phi-4-MM, Gemma 3's crops: the size follows the image
                nbytes = self.vision.image_nbytes(image.height, image.width, pixels)
                if not self.cache.known(key, salt):  # a Prefetch's too: checked before it is produced
                    self.cost_cap.check(index, image.height, image.width, nbytes)
            fut, produce = self.cache.acquire(key, want_lease, nbytes, produce=image is not None, salt=salt,
                                              owner=owner, for_ask=for_ask)
        # SaltClash: a hash collision; EntryKind: a video's hash given for an image
        except (CacheFullError, SaltClashError, ImageGeometryError, EntryKindError, ServiceError) as exc:
            _release_images([(key, image)])
            raise self._map_error(index, exc) from None
        if produce:
            self.worker.submit(key, image, priority, pixels)
            return fut
        _release_images([(key, image)])  # a hit, or joined a production: its pixels are not needed
        if fut is None:  # absent, or made under another salt: the same answer either way
            raise not_found(f"image {index}: content hash {key} is not in the encoder cache; "
                            "send the image bytes instead")
        if priority == DEMAND and not fut.done():
            self.worker.boost(key)  # joined a queued prefetch: it is needed now
        return fut

    def _acquire_video(self, index: int, key: str, job: VideoJob | None, want_lease: bool, priority: int,
                       salt: str, owner: str = "", for_ask: bool = False) -> cf.Future:
        """_acquire for video `index`: its size is known from the header-derived grid, so a video that
        cannot fit fails before it is decoded; a miss goes to the vision worker as a VideoJob."""
        try:
            nbytes = self.vision.nbytes_for(job.plan.grid) if job is not None else None
            fut, produce = self.cache.acquire(key, want_lease, nbytes, produce=job is not None, salt=salt,
                                              owner=owner, video=True, for_ask=for_ask)
        except (CacheFullError, SaltClashError, EntryKindError) as exc:
            raise self._map_error(index, exc, "video") from None
        if produce:
            self.video_lane.start(key, job, priority)
            return fut
        if fut is None:
            raise not_found(f"video {index}: content hash {key} is not in the encoder cache; "
                            "send the video bytes instead")
        if priority == DEMAND and not fut.done() and not self.video_lane.boost(key):
            self.worker.boost(key)  # decoded already: raise its queued job
        return fut

    @staticmethod
    def _map_error(index: int, exc: BaseException, kind: str = "image") -> ServiceError:
        """The status for input `index`'s failure (kind: image or video; a ServiceError raised here is
        already one)."""
        if isinstance(exc, ServiceError):
            return exc
        return as_service_error(exc, f"{kind} {index}: ")

    def _inline_bytes(self, handle: Handle) -> bytes:
        """Copy an entry out (under its lease) for the inline transport; runs in a thread."""
        view = self.cache.read(handle.entry)
        return inline_payload(view)

    # -- RPCs --------------------------------------------------------------------------------------

    async def Encode(self, request: encoder_pb2.EncodeRequest, context) -> encoder_pb2.EncodeResponse:
        with self.encode_bytes.holding(request.ByteSize()):
            return await self._encode(request, context)

    async def _encode(self, request: encoder_pb2.EncodeRequest, context) -> encoder_pb2.EncodeResponse:
        started, asked_at = time.perf_counter(), self.cache.now()  # the leases' time counts from here
        self._check_open()
        try:
            transport = choose_transport(request.accept, self.served)
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
        self._check_count(request.images, request.videos)
        self._check_owner(request.lease_owner)
        self._check_salt(request.cache_salt)
        salt, owner = request.cache_salt, request.lease_owner
        checked = time.perf_counter()
        # counted as decode: another call brings or decodes it
        await self._await_pending([*request.images, *request.videos], salt, request.await_file_ms)
        pending, items, videos = await self._registered_inputs(request, salt)
        decoded = time.perf_counter()
        priority = PREFETCH if request.prefetch else DEMAND
        futures: list[cf.Future] = []
        handles: list[Handle] = []
        try:
            with self.worker.holding():
                try:
                    self._check_geometry(items, request.images, salt)  # all, before any is queued
                    for i, (key, image) in enumerate(items):
                        futures.append(self._acquire(i, key, image, True, priority, salt, owner,
                                                     self._pixels(i, request.images[i])))
                    for i, (key, job) in enumerate(videos):  # refs: images first, then videos
                        futures.append(self._acquire_video(i, key, job, True, priority, salt, owner))
                finally:
                    self.pending.end(pending)  # the entries exist: asks by hash find them now
            waiting = time.perf_counter()
            for n, fut in enumerate(futures):
                try:
                    # A hit is resolved already: take it without a trip through the event loop.
                    handles.append(fut.result() if fut.done() else await self._bridge().wrap(fut))
                except (asyncio.CancelledError, ServiceError):
                    raise
                except Exception as exc:
                    video = n >= len(items)
                    raise self._map_error(n - len(items) if video else n, exc,
                                          "video" if video else "image") from None
            refs = []
            for handle in handles:
                if transport == common_pb2.TRANSPORT_INLINE:
                    data = await asyncio.to_thread(self._inline_bytes, handle)
                    self.cache.release([handle.lease_id], owner)
                    refs.append(build_ref(handle, transport, self.cache.arena, data))
                else:
                    refs.append(build_ref(handle, transport, self.cache.arena, nixl=self.nixl,
                                          nixl_agent_known=request.nixl_agent, asked_at=asked_at))
        except BaseException:
            _release_images(items[len(futures):])  # not handed to _acquire (the rest it released)
            for fut in futures:
                _release_when_done(self.cache, fut, owner)
            raise
        if transport != common_pb2.TRANSPORT_INLINE:
            leases = [h.lease_id for h in handles if h.lease_id]
            if owner and request.request_id:  # the caller may cancel as this answer leaves: see Release
                self.cache.name_leases(leases, request.request_id)
            self._release_if_undelivered(context, leases, owner)
        ended = time.perf_counter()
        self.metrics.observe_encode(ended - started, all(h.hit for h in handles))
        jobs = [self.worker.job_times(key) for key, _ in (*items, *videos)]
        split = split_encode(started, checked, decoded, waiting, ended, jobs)
        self.stage_totals.add(split)
        self.metrics.observe_stages(split)
        return encoder_pb2.EncodeResponse(embeddings=refs)

    def _release_if_undelivered(self, context, lease_ids: list[str], owner: str) -> None:
        """Give leases back when their answer never reaches the caller: a decoder cancels an Encode whose
        image it no longer needs (its request ended, a prefix hit covered it), and a cancel that lands
        after the handler returned drops the answer, leaving leases no one knows until they expire."""
        if lease_ids:
            context.add_done_callback(
                lambda ctx: self.cache.release(lease_ids, owner) if ctx.cancelled() else None)

    async def Prefetch(self, request: encoder_pb2.PrefetchRequest, context) -> encoder_pb2.PrefetchResponse:
        self._check_open()
        self._check_count(request.images, request.videos)
        self._check_salt(request.cache_salt)
        salt = request.cache_salt
        pending, items, videos = await self._registered_inputs(request, salt)
        accepted = 0
        # A decoder's files sent ahead belong to a request that has arrived: demand work (its batches
        # replay the tower's CUDA graphs on the demand stream), not lookahead; that request's own Encode
        # of what they produce is answered as the miss it is, however it races them. They are that
        # request's too: produced while its ask waits for them (or, before it asks, for
        # --sent-ahead-claim), so a request that ends leaves nothing running (EmbeddingCache.acquire).
        ahead = request.needed_now
        priority = DEMAND if ahead else PREFETCH
        acquires = [(lambda i=i, key=key, image=image: self._acquire(
            i, key, image, False, priority, salt, "", self._pixels(i, request.images[i]), for_ask=ahead))
            for i, (key, image) in enumerate(items)]
        acquires += [functools.partial(self._acquire_video, i, key, job, False, priority, salt, for_ask=ahead)
                     for i, (key, job) in enumerate(videos)]
        try:
            for acquire in acquires:
                try:
                    acquire()
                except ServiceError as exc:  # fire-and-forget: an input that cannot be cached is skipped
                    log.info("prefetch skipped: %s", exc.message)
                    continue
                accepted += 1
        finally:
            self.pending.end(pending)
        self.prefetches += accepted
        return encoder_pb2.PrefetchResponse(accepted=accepted)

    async def Release(self, request: encoder_pb2.ReleaseRequest, context) -> encoder_pb2.ReleaseResponse:
        # Another owner's lease counts like an unknown id: nothing is freed and nothing is revealed.
        # (An over-long owner needs no check here: it owns nothing, so it frees nothing.)
        owner = request.lease_owner
        released = self.cache.release(list(request.lease_ids), owner)
        released += self.cache.release_asks(list(request.request_ids), owner)
        return encoder_pb2.ReleaseResponse(released=released)

    async def Lookup(self, request: encoder_pb2.LookupRequest, context) -> encoder_pb2.LookupResponse:
        # A hash is "cached" only under the salt its entry was made with: no probing other tenants.
        salt = request.cache_salt
        self._check_salt(salt)
        entries = [self.cache.peek(h.lower(), salt) for h in request.content_hashes]
        return encoder_pb2.LookupResponse(cached=[e is not None for e in entries],
                                          grids=[grid_message(e) for e in entries])

    def stats(self) -> EncoderStats:
        """The service's stats record: the cache, the worker and the service's counters, read now."""
        c, w, pool = self.cache.stats(), self.worker, self.decode_pool
        graphs = self.vision.graphs
        stage_seconds, encode_calls = self.stage_totals.snapshot()
        return EncoderStats(
            cache_bytes_used=c.bytes_used, cache_bytes_capacity=c.capacity, entries=c.entries, hits=c.hits,
            misses=c.misses, evictions=c.evictions, leased_bytes=c.leased_bytes,
            active_leases=c.active_leases, encodes=w.encodes, images_per_s=w.images_per_s(),
            expired_leases=c.expired_leases, inflight_dedups=c.inflight_dedups, prefetches=self.prefetches,
            vision_batches=w.batches, queue_depth=w.queued(),
            cuda_graphs=int(graphs is not None), tower_graphs=0 if graphs is None else len(graphs),
            **device_memory(self.vision.device),
            decode_processes=0 if pool is None or pool.disabled else len(pool.pids),
            decode_restarts=0 if pool is None else pool.restarts,
            stage_seconds=stage_seconds, encode_calls=encode_calls, tower_gpu_seconds=w.tower_gpu_s,
            tower_thread_seconds=w.thread_times.snapshot()[0],
            model_fingerprint=self.vision.fingerprint, device=str(self.vision.device),
            transports=transport_names(self.served))

    async def GetStats(self, request: common_pb2.StatsRequest, context) -> encoder_pb2.EncoderStats:
        return to_message(self.stats(), encoder_pb2.EncoderStats)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def warm_up(self) -> None:
        """Start the decode processes and run one dummy image through the tower, off the event loop."""
        if self.decode_pool is not None:
            await asyncio.to_thread(self.decode_pool.start)
            self.decode_pool.listen()
        await asyncio.to_thread(self.vision.warm_up)

    async def close(self) -> None:
        """Refuse new work, stop the worker, free the arena (unlinks the SHM segment)."""
        self._closing = True
        await asyncio.to_thread(self.worker.stop)
        self.video_lane.shutdown()
        if self.decode_pool is not None:
            await asyncio.to_thread(self.decode_pool.close)
        if self.nixl is not None:  # before the arena it registered is freed
            await asyncio.to_thread(self.nixl.close)
        self.cache.close()
        self.metrics.close()
