"""Output processing: what the scheduler's per-request updates mean to a client.

After each step the scheduler reports, per request, the tokens it sampled and whether it ended
(`RequestUpdate`). The output processor turns those into `RequestOutput`s: it detokenizes (every request
when `detokenize` is on, else only requests with stop strings, since stopping on a string needs the
text), ends a request whose text reached a stop string (through the scheduler, the only owner of request
state), and adds usage to each request's first and last outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.engine.request import FinishReason, Request
from decoder_svc.engine.ttft_stages import RequestTimes
from decoder_svc.runner.sampler import TokenLogprobs

if TYPE_CHECKING:
    from decoder_svc.engine.scheduler import RequestUpdate, Scheduler

log = logging.getLogger("mmserve.decoder.engine")


@dataclass
class Usage:
    """Per-request accounting, filled on the first and the last output."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    images: int
    images_encoder_cache_hits: int
    images_skipped_by_kv_reuse: int

    @classmethod
    def of(cls, req: Request) -> Usage:
        """The usage of a request so far (image counts: images only, not a video's runs; an image of
        several runs, Gemma 3's crops, once, by its first)."""
        images = [i for i in req.images if i.video is None and not i.row_offset]
        return cls(
            prompt_tokens=req.num_prompt_tokens, completion_tokens=len(req.output_token_ids),
            cached_prompt_tokens=req.num_cached_tokens or 0, images=len(images),
            images_encoder_cache_hits=sum(i.encoder_cache_hit and not i.skipped_by_kv_reuse for i in images),
            images_skipped_by_kv_reuse=sum(i.skipped_by_kv_reuse for i in images))


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: str | None = None  # the gRPC status name the error calls for; None: INTERNAL
    times: RequestTimes | None = None  # on the output with the first token: where its TTFT went
    index: int = 0  # which sample of its request's prompt (GenerateRequest.n) it is

    @property
    def finished(self) -> bool:
        """True on the request's last output."""
        return self.finish_reason is not None


class OutputProcessor:
    """Detokenization, stop strings and usage; see the module docstring."""

    def __init__(self, tokenizer, detokenize: bool) -> None:
        self.tokenizer = tokenizer  # a transformers tokenizer
        self.detokenize = detokenize
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, req: Request) -> None:
        """Start following a request that was just queued."""
        if self.detokenize or req.sampling.stop:
            self._detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.sampling.stop)

    def process(self, updates: list[RequestUpdate], scheduler: Scheduler) -> list[RequestOutput]:
        """One output per update, in order."""
        return [self._output(update, scheduler) for update in updates]

    def _output(self, update: RequestUpdate, scheduler: Scheduler) -> RequestOutput:
        req = update.request
        tokens, logprobs = update.new_token_ids, update.logprobs
        detok = self._detokenizers.get(req.request_id)
        text = ""
        if detok is not None and tokens:
            try:
                # Before min_tokens a stop string is not looked for (only text added later can stop).
                text = detok.add(tokens, check_stop=req.sampling.stops_allowed(len(req.output_token_ids)))
            except Exception as exc:  # noqa: BLE001 - a bug or odd text of this request only
                log.error("request %s failed inside the engine", req.request_id, exc_info=exc)
                scheduler.finish_request(req, FinishReason.ERROR, f"internal error: {type(exc).__name__}",
                                         reported=True)
                tokens, logprobs, detok = [], [], None
            else:
                if detok.stopped:
                    scheduler.finish_request(req, FinishReason.STOP, reported=True)
        first = bool(tokens) and len(req.output_token_ids) == len(tokens)
        times = req.times if first and req.choice == 0 else None  # a request's TTFT: its first sample's
        if not req.is_finished:
            # The first tokens' output carries the usage so far too: the prompt's counts are known once
            # it is prefilled, and a stream with usage on every chunk needs them (vLLM's
            # continuous_usage_stats); later outputs leave it to the last one.
            usage = Usage.of(req) if first else None
            return RequestOutput(req.output_id, tokens, text, logprobs, usage=usage, times=times,
                                 index=req.choice)
        if detok is not None and req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            text += detok.finish()
        self._detokenizers.pop(req.request_id, None)
        return RequestOutput(req.output_id, tokens, text, logprobs, req.finish_reason, Usage.of(req),
                             req.error, req.error_code, times, req.choice)

    @property
    def num_followed(self) -> int:
        """Requests with a detokenizer (tests: none once every request has ended)."""
        return len(self._detokenizers)
