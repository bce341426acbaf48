"""Continuous batching with chunked prefill, image-aware prefix reuse and preemption by recompute.

The step is three calls: `schedule()` picks the chunks and counts them as computed (the runner computes
them next), the model runner computes them, and `update_from_output()` takes in what it sampled (images
given back, sampled tokens appended, stop and length checks). Only the scheduler changes request state:
every end of a request (stop, length, abort, failure) goes through `finish_request`.

Asynchronous scheduling: the engine may schedule step N+1 before it has read step N's sampled tokens. A
request then counts that token as pending (`num_pending_outputs`); N+1 may compute it (the runner takes
its id from N's output on the device), and a request that N ends (a stop token) wastes one token of N+1,
which update_from_output ignores. A request whose pending token reaches its length limit waits instead.

Each step shares one token budget: running requests first (decodes before prefill chunks), then
waiting requests in arrival order. A chunk stops before the first image whose embedding is not ready;
that request waits while others go on. Where images attend to themselves bidirectionally (`whole_images`,
Gemma 3) a chunk never cuts an image: it ends before one it cannot hold whole, and an image (or the rest
of one, after a prefix hit inside it) larger than the budget runs as the step's first prefill chunk, over
the budget. When blocks run out, the most recently admitted running request
is preempted: its blocks are freed (they stay cached, so its recompute often hits) and it goes back to
the front of the queue. Sliding-window layers (Gemma 3) change nothing here: the KV cache manager frees
their blocks as a request's computed tokens move its window (engine/kv_cache_manager.py).

Burst ordering (issue 65; tests/engine/test_burst_order.py): when many image requests arrive at once,
the first ones' first tokens are worth more than starting them all. The rule follows from the order
above, with nothing else to weigh: the encoder is asked for images in arrival order (the waiting loop's
demand asks, then lookahead's over the queue's head); requests whose embeddings are ready are prefilled
in arrival order (admitted requests run before waiting ones, each set in arrival order; a preempted one
goes back to the queue's front); and since a running prompt's chunk takes the budget before the next
prompt's, one prompt's chunks are finished before the next prompt's first chunk when the budget cannot
hold both (the next one takes only what is left). A request whose image is late does not hold back the
ready ones behind it, and takes its place again once its image is ready.

A request for n samples of one prompt is prefilled once, up to its prompt's last token, then forked into
n requests that share its KV (engine/fanout.py): the fork happens at the start of the next schedule(),
and the step's block copies go to the runner with the step (`SchedulerOutput.block_copies`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.embedding_source import EmbeddingSource, EmbeddingState
from decoder_svc.engine.fanout import fork_child, shares_prefill
from decoder_svc.engine.image_inputs import ImageInputs
from decoder_svc.engine.kv_cache_manager import KVCacheManager
from decoder_svc.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from decoder_svc.runner import ModelOutput, TokenLogprobs


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    encoder_max_ahead: int = 4  # waiting requests whose images are prefetched each step
    max_model_len: int | None = None  # a request stops (LENGTH) at this many tokens; None: no limit
    whole_images: bool = False  # a fresh chunk never splits an image (bidirectional image attention)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a request, computed this step; `samples` when the chunk
    reaches the request's last token (pending ones included), so its logits pick the next one."""

    request: Request
    start: int
    num_tokens: int
    samples: bool = False

    @property
    def end(self) -> int:
        """One past the chunk's last token."""
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """What one step computes, and what changed while scheduling it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests ended since the last schedule(): the runner drops its per-request state (seeded sampling).
    finished_request_ids: list[str] = field(default_factory=list)
    # Samples forked this step (engine/fanout.py), and the KV blocks (group, source, destination) the
    # runner copies for them before it computes the step.
    forked: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class RequestUpdate:
    """What a step did for one request: the tokens it sampled (none for an ended request that was not
    scheduled, e.g. aborted); `request.is_finished` says whether it ended."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    """Monotonic counters for stats (the images' are ImageInputs.counters)."""

    preemptions: int = 0
    finished: int = 0  # ended by a stop condition or the length limit
    forked_in_kv: int = 0  # samples that started from another sample's prompt KV (no prefill of their own)
    forked_queued: int = 0  # samples queued as requests of their own (engine/fanout.py says when)
    aborted: int = 0
    failed: int = 0

    def count_end(self, reason: FinishReason) -> None:
        """Count one ended request."""
        if reason == FinishReason.ABORT:
            self.aborted += 1
        elif reason == FinishReason.ERROR:
            self.failed += 1
        else:
            self.finished += 1


class Scheduler:
    """Decides, each step, which tokens of which requests to compute."""

    def __init__(self, config: SchedulerConfig, blocks: KVCacheManager | BlockManager,
                 source: EmbeddingSource) -> None:
        """`blocks`: the engine's KVCacheManager (one pool per KV cache group), or a bare BlockManager
        (one pool); both find prefixes, allocate and free alike."""
        self.config = config
        self.blocks = blocks
        self.images = ImageInputs(source)  # every image's readiness, rows and release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # queued, running, or ended and not reported yet
        self._unreported: list[Request] = []  # ended outside update_from_output: reported by the next
        self._finished_ids: list[str] = []  # ended since the last schedule()
        self.counters = SchedulerCounters()
        self.families: dict[str, list[Request]] = {}  # a forked request's id -> its live samples

    # -- membership ------------------------------------------------------------------------------
    def add(self, request: Request) -> list[Request]:
        """Queue a new request (its id must not be in `requests`). Returns the requests queued: itself,
        and for n samples that cannot share its KV (fanout.shares_prefill) the other samples too."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.times.added = time.monotonic()
        if request.awaits_fork and not shares_prefill(request):
            children = [fork_child(request, i, in_kv=False) for i in range(1, request.n)]
            self.families[request.request_id] = [request, *children]
            request.n = 1
            for child in children:
                self.requests[child.request_id] = child
                self.waiting.append(child)
                child.times.added = request.times.added
            self.counters.forked_queued += len(children)
            return [request, *children]
        return [request]

    def _fork(self, parent: Request, out: SchedulerOutput) -> None:
        """Fork a request prefilled up to its prompt's last token into its n samples (fanout.py): as many
        as the sequence budget and the pool allow share its KV and run now; the rest are queued, first in
        line, as requests of their own."""
        family, queued = [parent], []
        seats = self.config.max_num_seqs - len(self.running)
        for i in range(1, parent.n):
            child = fork_child(parent, i, in_kv=seats > 0)
            copies = self._share_kv(parent, child) if seats > 0 else None
            if copies is None:
                child = fork_child(parent, i, in_kv=False)
                queued.append(child)
            else:
                seats -= 1
                out.block_copies += copies
                self.running.append(child)
                self.counters.forked_in_kv += 1
            self.requests[child.request_id] = child
            child.times.added = parent.times.added
            family.append(child)
            out.forked.append(child)
        for child in reversed(queued):
            self.waiting.appendleft(child)
        self.counters.forked_queued += len(queued)
        self.families[parent.request_id] = family
        parent.n = 1

    def _share_kv(self, parent: Request, child: Request) -> list[tuple[int, int, int]] | None:
        """The child's table of the parent's KV, and the copies it needs (None: no free block)."""
        blocks = self.blocks
        if isinstance(blocks, KVCacheManager):
            return blocks.fork(parent, child)
        if blocks.fork_needs(parent) > blocks.num_free_blocks:
            return None
        copy = blocks.fork(parent, child)
        return [] if copy is None else [(0, *copy)]

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running, or an ended one is still to be reported."""
        return bool(self.waiting or self.running or self._unreported)

    def get(self, request_id: str) -> Request | None:
        """The live (not ended) request with this id, if any."""
        req = self.requests.get(request_id)
        return req if req is not None and not req.is_finished else None

    def live_samples(self, request_id: str) -> list[Request]:
        """The live requests of the request with this id: itself, or every sample forked from it."""
        family = self.families.get(request_id)
        if family is not None:
            return [r for r in family if not r.is_finished]
        req = self.get(request_id)
        return [req] if req is not None else []

    def finish_request(self, request: Request, reason: FinishReason, error: str | None = None, *,
                       reported: bool = False) -> None:
        """End a request: the one path for stop, length, abort and failure. It leaves the queues and
        its KV blocks and embeddings are freed. Its last update comes with the next update_from_output,
        unless the caller reports it itself (`reported`). Ending an ended request does nothing."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        self.images.free(request)
        request.finish(reason, error)
        self.counters.count_end(reason)
        self._finished_ids.append(request.request_id)
        family = self.families.get(request.output_id)
        if family is not None and all(r.is_finished for r in family):
            del self.families[request.output_id]
        if reported:
            self.requests.pop(request.request_id, None)
        else:
            self._unreported.append(request)

    # -- the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks under the token and sequence budgets."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        for req in [r for r in self.running if r.awaits_fork and r.num_computed_tokens == r.schedule_end]:
            self._fork(req, out)
        failed: list[Request] = []  # an image failed: the request ends with the image's error
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        prefilling = False  # a prefill chunk is in the step (an image over the budget must come first)

        # Running requests: decodes first, then their prefill chunks (sort is stable).
        for req in sorted(self.running, key=lambda r: r.schedule_end - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or self._pending_reaches_limit(req):
                continue  # preempted earlier in this loop, or its last token is on its way
            wanted = min(req.schedule_end - req.num_computed_tokens, budget)
            if wanted <= 0:
                continue  # prefilled up to its fork, which waits for a block
            n = self._limit_by_images(req, req.num_computed_tokens, wanted, failed, not prefilling)
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
                out.chunks.append(self._chunk(req, req.num_computed_tokens, n))
                scheduled.add(req.request_id)
                budget = max(budget - n, 0)
                prefilling |= req.num_computed_tokens < req.num_prompt_tokens

        # Waiting requests, in order; one that waits for an image does not block those behind it.
        if not out.preempted:
            held = 0  # requests kept queued for their image: they hold a slot, so demand stays bounded
            for req in list(self.waiting):
                if budget == 0 or len(self.running) + held >= self.config.max_num_seqs:
                    break
                hit_blocks = self.blocks.find_cached_prefix(req)
                hit = len(hit_blocks) * self.blocks.block_size
                wanted = min(req.schedule_end - hit, budget)
                if wanted == 0:  # a fork whose prompt is cached up to its last token: forked next step
                    if not self.blocks.allocate_slots(req, 0, hit_blocks):
                        break
                    self._admit(req, hit)
                    continue
                n = self._limit_by_images(req, hit, wanted, failed, not prefilling)
                if n == 0 or (n < wanted and n < self.blocks.block_size and self._awaits_image(req, hit + n)):
                    # Cut short by an image not ready yet, before filling a block: wait in the queue
                    # instead. Admitted once the image is ready, it finds the blocks that requests with
                    # the same image computed meanwhile (or in the same step) and skips them.
                    held += 1
                    continue
                if not self.blocks.allocate_slots(req, n, hit_blocks):
                    break  # the pool is full: keep arrival order for the rest
                self._admit(req, hit)
                out.chunks.append(self._chunk(req, hit, n))
                budget = max(budget - n, 0)
                prefilling = True

        for req in failed:
            self.finish_request(req, FinishReason.ERROR, req.error)
        for chunk in out.chunks:  # the runner computes them next
            chunk.request.num_computed_tokens = chunk.end
            chunk.request.num_pending_outputs += chunk.samples
        self._lookahead()
        return out

    @staticmethod
    def _chunk(req: Request, start: int, n: int) -> ScheduledChunk:
        return ScheduledChunk(req, start, n, samples=start + n == req.num_tokens_with_pending)

    def _pending_reaches_limit(self, req: Request) -> bool:
        """True when the token a launched step samples for req ends it by length: no step after it."""
        if not req.num_pending_outputs:
            return False
        max_len = self.config.max_model_len
        return (len(req.output_token_ids) + req.num_pending_outputs >= req.max_tokens
                or (max_len is not None and req.num_tokens_with_pending >= max_len))

    def _admit(self, req: Request, hit: int) -> None:
        self.blocks.record_prefix_query(req.num_tokens, hit, req.lora_adapter)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit
        req.num_computed_tokens = hit
        self.images.skip_cached(req, hit)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING

    def update_from_output(self, scheduled: SchedulerOutput,
                           output: ModelOutput | None) -> list[RequestUpdate]:
        """Take in what the runner computed for `scheduled` (None: nothing, e.g. the batch failed): images
        whose every token is in KV are given back, sampled tokens are appended (one per chunk that
        `samples`, in order) and stop conditions checked; requests that ended meanwhile (aborted, failed,
        or stopped by the step before) ignore theirs. Returns an update for every request that sampled a
        token or ended since the last call."""
        updates = [RequestUpdate(req) for req in self._unreported]
        for req in self._unreported:
            self.requests.pop(req.request_id, None)
        self._unreported = []
        if output is None:
            return updates
        for chunk in scheduled.chunks:
            if not chunk.request.is_finished:
                self.images.release_computed(chunk.request, chunk.end)
        sampling = [c.request for c in scheduled.chunks if c.samples]
        sampled = output.sampled
        for req, token, logprobs in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            req.num_pending_outputs -= 1
            if req.is_finished:
                continue
            req.output_token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish_request(req, reason, reported=True)
            updates.append(RequestUpdate(req, [token], [logprobs] if logprobs is not None else []))
        return updates

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        """STOP on a stop or end-of-sequence token, LENGTH at max_tokens or the model's length."""
        sp = req.sampling
        if sp.stops_allowed(len(req.output_token_ids)) and (
                token in sp.stop_token_ids or (token in req.eos_token_ids and not sp.ignore_eos)):
            return FinishReason.STOP
        max_len = self.config.max_model_len
        if len(req.output_token_ids) >= req.max_tokens or (max_len is not None and req.num_tokens >= max_len):
            return FinishReason.LENGTH
        return None

    # -- images ----------------------------------------------------------------------------------
    def _limit_by_images(self, req: Request, start: int, n: int, failed: list[Request],
                         may_exceed: bool = False) -> int:
        """n, or fewer tokens so the chunk ends before the first image whose embedding is not ready
        (with whole_images: or that it would cut; an image it starts in, it holds whole, over n only
        where `may_exceed`, else 0)."""
        end = start + n
        for img in req.images:
            if img.end <= start or img.offset >= end:
                continue
            state = self.images.readiness(req, img)
            if state == EmbeddingState.FAILED:
                failed.append(req)
                return 0
            if state != EmbeddingState.READY:
                return max(img.offset - start, 0)
            if self.config.whole_images and img.end > end:
                if img.offset > start:
                    return img.offset - start
                return img.end - start if may_exceed else 0
        return n

    def _awaits_image(self, req: Request, position: int) -> bool:
        """True when an image whose embedding is not ready starts at `position` (a chunk cut there waits
        for it; one cut before an image it would split goes on)."""
        return any(img.offset == position and img.state != EmbeddingState.READY for img in req.images)

    def _lookahead(self) -> None:
        """Ask for the images of the next queued requests before their prefill (prefetch=True)."""
        queued = [req for req in list(self.waiting)[:self.config.encoder_max_ahead]
                  if any(img.state == EmbeddingState.UNKNOWN for img in req.images)]
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
