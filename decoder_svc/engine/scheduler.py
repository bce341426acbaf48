"""Continuous batching with chunked prefill, image-aware prefix reuse and preemption by recompute.

Each step shares one token budget: running requests first (decodes before prefill chunks), then
waiting requests in arrival order. A chunk stops before the first image whose embedding is not ready;
that request waits while others go on. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed (they stay cached, so its recompute often hits) and it goes back to
the front of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.embedding_source import EmbeddingSource
from decoder_svc.engine.image_inputs import ImageInputs
from decoder_svc.engine.request import EmbeddingState, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    encoder_max_ahead: int = 4  # waiting requests whose images are prefetched each step


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a request, computed this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        """One past the chunk's last token."""
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the request's last token, so its logits pick the next one."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one step computes, and what changed while scheduling it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # an image failed: finish with an error

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerCounters:
    """Monotonic counters for stats (the images' are ImageInputs.counters)."""

    preemptions: int = 0


class Scheduler:
    """Decides, each step, which tokens of which requests to compute."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, source: EmbeddingSource) -> None:
        self.config = config
        self.blocks = blocks
        self.images = ImageInputs(source)  # every image's readiness, rows and release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    # -- membership ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a new request."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Request | None:
        """The live request with this id, if any."""
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks and embeddings (finish, abort, failure)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        self.images.free(request)

    # -- the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks under the token and sequence budgets."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        # Running requests: decodes first, then their prefill chunks (sort is stable).
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._limit_by_images(req, req.num_computed_tokens,
                                      min(req.num_tokens - req.num_computed_tokens, budget), out)
            if n == 0:
                continue
            while not self.blocks.allocate_slots(req, n):
                victim = self._pick_victim(scheduled | {req.request_id})
                if victim is None:  # nothing else to free: this request yields its own blocks
                    victim = req
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                scheduled.add(req.request_id)
                budget -= n

        # Waiting requests, in order; one that waits for an image does not block those behind it.
        if not out.preempted:
            held = 0  # requests kept queued for their image: they hold a slot, so demand stays bounded
            for req in list(self.waiting):
                if budget == 0 or len(self.running) + held >= self.config.max_num_seqs:
                    break
                hit_blocks = self.blocks.find_cached_prefix(req)
                hit = len(hit_blocks) * self.blocks.block_size
                wanted = min(req.num_tokens - hit, budget)
                n = self._limit_by_images(req, hit, wanted, out)
                if n == 0 or (n < wanted and n < self.blocks.block_size):
                    # Cut short by an image not ready yet, before filling a block: wait in the queue
                    # instead. Admitted once the image is ready, it finds the blocks that requests with
                    # the same image computed meanwhile (or in the same step) and skips them.
                    held += 1
                    continue
                if not self.blocks.allocate_slots(req, n, hit_blocks):
                    break  # the pool is full: keep arrival order for the rest
                self._admit(req, hit)
                out.chunks.append(ScheduledChunk(req, hit, n))
                budget -= n

        for req in out.failed:
            self.remove(req)
        self._lookahead()
        return out

    def _admit(self, req: Request, hit: int) -> None:
        self.blocks.record_prefix_query(req.num_tokens, hit)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit
        req.num_computed_tokens = hit
        self.images.skip_cached(req, hit)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING

    def update_after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed tokens; release each image once every one of its tokens is in KV."""
        for chunk in chunks:
            chunk.request.num_computed_tokens = chunk.end
            self.images.release_computed(chunk.request)

    # -- images ----------------------------------------------------------------------------------
    def _limit_by_images(self, req: Request, start: int, n: int, out: SchedulerOutput) -> int:
        """n, or fewer tokens so the chunk ends before the first image whose embedding is not ready."""
        end = start + n
        for img in req.images:
            if img.end <= start or img.offset >= end:
                continue
            state = self.images.readiness(req, img)
            if state == EmbeddingState.FAILED:
                out.failed.append(req)
                return 0
            if state != EmbeddingState.READY:
                return max(img.offset - start, 0)
        return n

    def _lookahead(self) -> None:
        """Ask for the images of the next queued requests before their prefill (prefetch=True)."""
        queued = [req for req in list(self.waiting)[:self.config.encoder_max_ahead]
                  if any(img.state == EmbeddingState.PENDING for img in req.images)]
        self.images.lookahead([(req, len(self.blocks.find_cached_prefix(req)) * self.blocks.block_size)
                               for req in queued])

    # -- preemption ------------------------------------------------------------------------------
    def _pick_victim(self, exclude: set[str]) -> Request | None:
        for req in reversed(self.running):
            if req.request_id not in exclude:
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        self.images.free(req, ask_again=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(req)
