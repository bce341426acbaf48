"""An in-process embedding source: the checkpoint's vision tower (+ projector), run synchronously.

It runs the encoder service's own vision encoder (which reproduces `get_image_features` of
LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration)
in-process, so the engine can be tested alone against HF. Its tensors have the encoder service's shapes:
[rows, hidden], or [parts, rows, hidden] for Qwen3-VL (the merged features, then each DeepStack level).
Videos (Qwen-VL) are decoded and patched with common/video and encoded with the video's grid, as in the
encoder service. It keeps a small LRU of embeddings by content hash so that repeated images count as
encoder-cache hits.
Like the encoder service, an entry answers a hash-only ask only under the cache_salt it was made with;
under any other salt the image is "not found".
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.checkpoint import load_config, parse_dtype
from common.families import family_of
from common.images import decode_image, to_rgb
from common.video import VideoLimits, decode_video, video_patches, video_request_config
from common.vision.encoders import make_vision_encoder
from common.vision.prepared import PreparedGrid
from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingSource, EmbeddingState, VideoSource
from decoder_svc.engine.following_bytes import FollowingBytes, file_bytes

if TYPE_CHECKING:
    from decoder_svc.engine.config import EngineConfig

_FOLLOWING_BYTES_TIMEOUT_S = 30.0  # a file that follows its request: the front end sends it right after


class LocalEmbeddingSource(EmbeddingSource):
    """Runs the vision encoder inside `request` (synchronous), caching embeddings by content hash."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, cache_entries: int = 256) -> None:
        # Preprocessing as the family declares it (common/families/): LLaVA's HF image processor always
        # (the engine's HF-parity tests run against it); Qwen-VL's "auto", HF's processor in fp32 and on
        # CPUs, the device-side one on a GPU in half precision (its host one takes ~90 ms for 1024x1024).
        family = family_of(load_config(model_dir))
        self.encoder = make_vision_encoder(model_dir, device, dtype, preprocess=family.local_preprocess)
        self.video_limits = VideoLimits()
        self.cache_entries = cache_entries
        # hash -> (salt, embedding); a multi-part embedding is one entry, as in the encoder's cache
        self._cache: OrderedDict[str, tuple[str, torch.Tensor]] = OrderedDict()
        self._leases: dict[tuple[str, str], tuple[EmbeddingState, bool, str]] = {}
        self.num_encoded = 0
        self.num_cache_hits = 0
        self.num_requests = 0

    @classmethod
    def for_engine(cls, config: EngineConfig) -> LocalEmbeddingSource:
        """The tower on the engine's device and dtype (tests, benchmarks and scripts)."""
        return cls(config.model, config.device, parse_dtype(config.dtype))

    def request(self, req: EmbeddingRequest) -> None:
        key = (req.request_id, req.content_hash)
        if key in self._leases:
            return
        self.num_requests += 1
        cached = self._cache.get(req.content_hash)
        if cached is not None and cached[0] == req.cache_salt:  # another tenant's entry is not a hit
            self._cache.move_to_end(req.content_hash)
            self.num_cache_hits += 1
            self._leases[key] = (EmbeddingState.READY, True, "")
            return
        if req.image is None and (req.video is None or req.video.data is None):
            self._leases[key] = (EmbeddingState.FAILED, False, f"image {req.content_hash[:16]} not found")
            return
        try:
            if req.video is not None:
                emb = self._encode_video(req.video)
            else:
                image = req.image
                if isinstance(image, FollowingBytes):  # behind its request on an engine core's pipe
                    image = file_bytes(image, _FOLLOWING_BYTES_TIMEOUT_S)
                image = decode_image(image) if isinstance(image, bytes) else to_rgb(image)
                if req.pixels is not None:  # a pixel range (Qwen-VL), a crop choice (Gemma 3)
                    emb = self.encoder.encode([image], [req.pixels])[0]
                else:
                    emb = self.encoder.encode([image])[0]
        except Exception as exc:  # noqa: BLE001 - any failure fails this image, not the engine
            self._leases[key] = (EmbeddingState.FAILED, False, f"{type(exc).__name__}: {exc}")
            return
        self.num_encoded += 1
        self._cache[req.content_hash] = (req.cache_salt, emb)
        while len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
        self._leases[key] = (EmbeddingState.READY, False, "")

    def _encode_video(self, video: VideoSource) -> torch.Tensor:
        """A video's embedding: its sampled frames decoded and patched (common/video), then the tower
        with the video's grid, as the encoder service does (the settings come resolved)."""
        config = video_request_config(self.encoder.video_config, video.fps, video.max_frames,
                                      video.min_pixels, video.max_pixels, self.video_limits)
        data = file_bytes(video.data, _FOLLOWING_BYTES_TIMEOUT_S)  # behind its request on a core's pipe
        decoded = decode_video(data, config.sampling.indices_for, self.video_limits)
        rows, grid = video_patches(decoded.frames, config)
        return self.encoder.encode_prepared([PreparedGrid(tuple(grid), pixel_values=rows)])[0]

    def poll(self, request_id: str, content_hash: str) -> EmbeddingState:
        return self._leases.get((request_id, content_hash), (EmbeddingState.UNKNOWN,))[0]

    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        if self.poll(request_id, content_hash) != EmbeddingState.READY:
            raise KeyError(f"embedding {content_hash[:16]} for {request_id} is not ready")
        cached = self._cache.get(content_hash)
        if cached is None:  # evicted while leased: recompute is impossible without the image
            raise KeyError(f"embedding {content_hash[:16]} was evicted")
        return cached[1]

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        if content_hash is not None:
            self._leases.pop((request_id, content_hash), None)
            return
        for key in [k for k in self._leases if k[0] == request_id]:
            del self._leases[key]

    def error(self, request_id: str, content_hash: str) -> str:
        return self._leases.get((request_id, content_hash), (None, False, "unknown image"))[2]

    def cache_hit(self, request_id: str, content_hash: str) -> bool:
        return self._leases.get((request_id, content_hash), (None, False))[1]

    @property
    def num_leases(self) -> int:
        """Keys currently held (a leak check for tests)."""
        return len(self._leases)
