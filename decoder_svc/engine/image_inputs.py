"""Image bookkeeping in one place (vLLM's EncoderCacheManager is the model): for each (request, content
hash), whether its embedding is asked for, ready, done with or skipped, its rows, and giving it back.

The scheduler asks `readiness` before it lets a chunk cover an image; the runner's rows come from
`rows_for_chunk`; and every way a request stops holding images goes through one of three calls:
`skip_cached` (the image's whole span is in cached KV: never needed), `release_computed` (every token of
the image is in KV: its rows are no longer read) and `free` (finish, abort, failure, preemption). The
embedding source is told `release` from these calls only.

An image may straddle chunks: a chunk covering tokens [start, end) takes rows
[max(start - offset, 0), min(end, offset + length) - offset) of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingSource, EmbeddingState
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.runner.fusion import FusionError


@dataclass
class ImageCounters:
    """Monotonic counters for stats."""

    images_encoded: int = 0
    images_encoder_cache_hits: int = 0
    images_skipped_by_kv_reuse: int = 0


class ImageInputs:
    """The images of the live requests and their embeddings; see the module docstring."""

    def __init__(self, source: EmbeddingSource) -> None:
        self.source = source
        # READY keys' rows: [length, hidden], or [parts, length, hidden] for multi-part (DeepStack) models
        self._rows: dict[tuple[str, str], torch.Tensor] = {}
        self.counters = ImageCounters()

    # -- readiness -------------------------------------------------------------------------------
    def readiness(self, req: Request, img: ImagePlaceholder) -> EmbeddingState:
        """Ask for the image as demand work if nobody has, or if only lookahead has (prefill has reached
        it: the source joins the lookahead ask and tells the encoder, which raises its queued low-priority
        job), and say where it stands (READY means its rows are here)."""
        rid, h = req.request_id, img.content_hash
        if img.state == EmbeddingState.PENDING and self.source.poll(rid, h) == EmbeddingState.UNKNOWN:
            img.state = EmbeddingState.UNKNOWN  # released earlier (the same hash done before): ask again
        if (img.state in (EmbeddingState.UNKNOWN, EmbeddingState.DONE, EmbeddingState.SKIPPED)
                or (img.state == EmbeddingState.PENDING and not img.needed_now)):
            self.source.request(EmbeddingRequest(rid, h, img.image, req.cache_salt, prefetch=False,
                                                 pixels=img.pixels, video=img.video,
                                                 sent_ahead=img.sent_ahead))
            img.state = EmbeddingState.PENDING
            img.needed_now = True
        if img.state == EmbeddingState.PENDING:
            status = self.source.poll(rid, h)
            if status == EmbeddingState.FAILED:
                img.state = EmbeddingState.FAILED
                req.error = req.error or self.source.error(rid, h) or "image failed"
                req.error_code = req.error_code or self.source.pop_error_code(rid)
            elif status == EmbeddingState.READY:
                self._take_rows(req, img)
        return img.state

    def _take_rows(self, req: Request, img: ImagePlaceholder) -> None:
        rid, h = req.request_id, img.content_hash
        rows = self.source.get(rid, h)
        if rows.dim() not in (2, 3) or rows.shape[-2] != img.total_rows:
            img.state = EmbeddingState.FAILED
            self.source.release(rid, h)
            req.error = (f"embedding of image at {img.offset} has shape {tuple(rows.shape)}, the prompt has "
                         f"{img.total_rows} tokens")
            return
        self._rows[(rid, h)] = rows
        img.state = EmbeddingState.READY
        req.times.note_image_ready(time.monotonic())
        img.encoder_cache_hit = self.source.cache_hit(rid, h)
        if img.row_offset:  # a later run of a video (or a cropped image): counted with its first
            return
        if img.encoder_cache_hit:
            self.counters.images_encoder_cache_hits += 1
        else:
            self.counters.images_encoded += 1

    def lookahead(self, queued: list[tuple[Request, int]]) -> None:
        """Ask (prefetch=True) for the images of queued requests, given with their cached-prefix length,
        that are not asked for yet; images inside the cached prefix are never asked for."""
        asks: list[EmbeddingRequest] = []
        for req, hit in queued:
            for img in req.images:
                if img.state == EmbeddingState.UNKNOWN and img.end > hit:
                    asks.append(EmbeddingRequest(req.request_id, img.content_hash, img.image, req.cache_salt,
                                                 prefetch=True, pixels=img.pixels, video=img.video,
                                                 sent_ahead=img.sent_ahead))
                    img.state = EmbeddingState.PENDING
                    img.needed_now = False
        if asks:
            self.source.lookahead(asks)

    # -- the runner's rows -----------------------------------------------------------------------
    def rows_for_chunk(self, req: Request, start: int, end: int) -> list[torch.Tensor]:
        """The embedding rows of every image token in [start, end), in token order ([n, hidden] each, or
        [parts, n, hidden] for multi-part embeddings)."""
        rows = []
        for img in sorted(req.images, key=lambda i: i.offset):
            lo, hi = max(start, img.offset), min(end, img.end)
            if lo >= hi:
                continue
            image_rows = self._rows.get((req.request_id, img.content_hash))
            if image_rows is None or img.state != EmbeddingState.READY:
                raise FusionError(f"request {req.request_id}: image at {img.offset} scheduled without its "
                                  "embedding")
            rows.append(image_rows.narrow(-2, img.row_offset + lo - img.offset, hi - lo))
        return rows

    # -- giving images back ----------------------------------------------------------------------
    def skip_cached(self, req: Request, hit: int) -> None:
        """Images whose whole span is in the first `hit` tokens (cached KV) are never needed. Their
        embedding goes back unless another copy of the same image in the prompt still needs it (the
        copies share one key: giving it back would take the rows from under a copy the scheduler has just
        found ready)."""
        still_needed = {img.content_hash for img in req.images if img.end > hit}
        for img in req.images:
            if img.end > hit:
                continue
            if (img.state in (EmbeddingState.PENDING, EmbeddingState.READY)
                    and img.content_hash not in still_needed):
                self._give_back(req, img.content_hash)
            if img.state != EmbeddingState.SKIPPED and not img.row_offset:  # a video (image) counts once
                self.counters.images_skipped_by_kv_reuse += 1
            img.state, img.skipped_by_kv_reuse = EmbeddingState.SKIPPED, True

    def release_computed(self, req: Request, done: int) -> None:
        """Images whose every token is below `done`, whose KV a finished step computed: their rows are
        never read again."""
        for img in req.images:
            if img.state == EmbeddingState.READY and img.end <= done:
                img.state = EmbeddingState.DONE
                # The same image twice in one prompt: keep its rows while another copy still needs them.
                # An embedding of several runs (a video's, a cropped image's) until its last run is
                # computed: given back between runs, the next run would ask for (and the encoder perhaps
                # decode) the whole of it again.
                if not any(o.content_hash == img.content_hash
                           and (o.state == EmbeddingState.READY
                                or (o.embedding_rows is not None and o.end > done))
                           for o in req.images):
                    self._give_back(req, img.content_hash)

    def free(self, req: Request, ask_again: bool = False) -> None:
        """Every end of a request (finish, abort, failure), and preemption (ask_again: its images will
        be asked for anew when it is scheduled again)."""
        self.source.release(req.request_id)
        for key in [k for k in self._rows if k[0] == req.request_id]:
            del self._rows[key]
        if ask_again:
            for img in req.images:
                img.state = EmbeddingState.UNKNOWN

    def _give_back(self, req: Request, content_hash: str) -> None:
        self.source.release(req.request_id, content_hash)
        self._rows.pop((req.request_id, content_hash), None)

    @property
    def num_held(self) -> int:
        """Keys whose rows are held (tests: nothing is held once every request has ended)."""
        return len(self._rows)
