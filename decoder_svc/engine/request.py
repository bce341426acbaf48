"""Request state. One rule for every phase: the request has num_tokens tokens (prompt + output) and
num_computed_tokens of them have KV in the cache; each step schedules some of the rest."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from common.image_geometry import Grid, ImageSettings
from decoder_svc.engine.embedding_source import EmbeddingState, VideoSource
from decoder_svc.engine.following_bytes import FollowingBytes
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.ttft_stages import RequestTimes

if TYPE_CHECKING:
    from PIL import Image


class RequestStatus(enum.Enum):
    """Where the request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request ended (mirrors the API's FinishReason, plus ERROR for failed requests)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class ImagePlaceholder:
    """One image of a request: its token span, content hash and embedding progress."""

    offset: int
    length: int
    content_hash: str
    # None: known to the encoder by hash only; FollowingBytes: a file on its way to the engine core
    image: bytes | Image.Image | FollowingBytes | None = None
    state: EmbeddingState = EmbeddingState.UNKNOWN
    encoder_cache_hit: bool = False
    skipped_by_kv_reuse: bool = False
    grid: Grid | None = None  # (t, h, w) patches of a Qwen2.5-VL image; None for fixed-size LLaVA images
    pixels: ImageSettings | None = None  # its pixel range or crop choice (part of its content hash)
    # A video is one embedding whose rows may fill several spans (Qwen3-VL: one per group of frames,
    # with timestamps between them): this span takes rows [row_offset, row_offset + length) of
    # embedding_rows. For an image both are the defaults: the span is the whole embedding.
    row_offset: int = 0
    embedding_rows: int | None = None
    video: VideoSource | None = None  # what the encoder is sent for a video (None: an image)
    sent_ahead: bool = False  # the front end sent the file to its encoder as the request arrived
    needed_now: bool = False  # asked for as demand work (prefill reached it), not only by lookahead

    @property
    def total_rows(self) -> int:
        """Rows of the whole embedding this span takes part of."""
        return self.length if self.embedding_rows is None else self.embedding_rows

    @property
    def end(self) -> int:
        """One past the last placeholder token."""
        return self.offset + self.length


@dataclass
class Request:
    """A generation request as the scheduler and engine see it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    images: list[ImagePlaceholder] = field(default_factory=list)
    cache_salt: str = ""
    lora_adapter: str = ""  # the LoRA adapter it runs with (a --lora-modules name); "": the base model
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is computed, or being computed by a launched step (the scheduler advances it when it
    # schedules a chunk; preemption resets it).
    num_computed_tokens: int = 0
    # Tokens a launched step samples that have not been read back yet (asynchronous scheduling: at most
    # one). The next step may already compute them: the runner takes their ids from the device.
    num_pending_outputs: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission; None until admitted
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # the gRPC status name `error` calls for (e.g. UNAVAILABLE); None: INTERNAL
    num_preemptions: int = 0
    # M-RoPE (Qwen2.5-VL): prompt positions [3, num_prompt_tokens], computed once at admission, and the
    # offset of later tokens' positions from their index. None: 1D positions.
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    times: RequestTimes = field(default_factory=RequestTimes)  # stamps up to the first token
    # Samples of one prompt (the API's GenerateRequest.n): a request with n > 1 is prefilled once and then
    # forked into n requests, choices 0..n-1 (engine/fanout.py); it is choice 0 and its n is 1 from then.
    n: int = 1
    choice: int = 0  # which of its prompt's samples this is (the API's GenerateResponse.index)
    stream_id: str = ""  # the request whose stream carries its outputs ("": its own)

    @property
    def output_id(self) -> str:
        """The id its outputs are delivered under: the request the client sent."""
        return self.stream_id or self.request_id

    @property
    def awaits_fork(self) -> bool:
        """True while the request is still one prompt to be forked into n samples."""
        return self.n > 1

    @property
    def schedule_end(self) -> int:
        """One past the last token the scheduler may compute now: every known token (pending ones
        included), or, before a fork, all but the prompt's last (each sample computes that one itself,
        and samples from its logits)."""
        return self.num_prompt_tokens - 1 if self.awaits_fork else self.num_tokens_with_pending

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length, image placeholders included."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Prompt plus generated tokens, counting those sampled by a launched step and not read yet."""
        return self.num_tokens + self.num_pending_outputs

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output ids."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        """True once the request has a finish reason."""
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Mark the request finished (the owner frees its resources)."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
