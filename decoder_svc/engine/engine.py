"""LLMEngine: the in-process decoder. Each step: schedule, hand the chunks to the model runner (which
runs the model and samples), update requests, free the finished."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.checkpoint import model_fingerprint, parse_dtype
from common.images import ImageLimits
from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.engine.embedding_source import EmbeddingSource
from decoder_svc.engine.input_processor import ImageLike, InputProcessor
from decoder_svc.engine.request import FinishReason, Request
from decoder_svc.engine.sampling_params import InvalidRequestError, SamplingParams
from decoder_svc.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from decoder_svc.model import generation_eos_ids, load_language_model
from decoder_svc.runner import (
    ModelInput,
    ModelRunner,
    RunnerConfig,
    SamplingRow,
    SequenceInput,
    TokenLogprobs,
)
from decoder_svc.tokenization import PromptTokenizer

log = logging.getLogger("mmserve.decoder.engine")
# Errors that leave the device unusable: the engine cannot absorb them (torch < 2.8 lacks the class).
_DEVICE_ERRORS = tuple(c for c in (getattr(torch, "AcceleratorError", None),) if c is not None)



class QueueFullError(RuntimeError):
    """Too many requests waiting (the service answers RESOURCE_EXHAUSTED)."""


@dataclass
class EngineConfig:
    """Everything the engine needs to start."""

    model_dir: str | Path
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None  # wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # default: half the free GPU memory, or 512 MiB on CPU
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    encoder_max_ahead: int = 4
    default_max_tokens: int = 256
    max_waiting: int = 4096
    enable_prefix_caching: bool = True
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # bytes, side, pixels, images/request
    max_prompt_bytes: int = 1 << 20  # prompt text (or chat text parts), checked before tokenizing
    attention_backend: str = "auto"  # auto: Triton kernels on CUDA, the torch reference elsewhere
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # False: outputs carry token ids and no text, except for requests with stop strings (stopping needs
    # the text). The service sets it and detokenizes on its event loop, so the engine thread spends
    # its time on steps, not on the tokenizer.
    detokenize: bool = True


@dataclass
class Usage:
    """Per-request accounting, filled on the last output."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    images: int
    images_encoder_cache_hits: int
    images_skipped_by_kv_reuse: int


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

    @property
    def finished(self) -> bool:
        """True on the request's last output."""
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """A snapshot of the engine's state and counters."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cached_free_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    images_encoded: int
    images_encoder_cache_hits: int
    images_skipped_by_kv_reuse: int
    preemptions: int
    finished: int
    aborted: int
    failed: int


class LLMEngine:
    """Continuous-batching generation over our paged-KV language model."""

    def __init__(self, config: EngineConfig, embedding_source: EmbeddingSource) -> None:
        """An engine over `embedding_source`: a remote one (decoder_svc.encoders.remote_source) in the
        service, LocalEmbeddingSource.for_engine(config) in-process."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.model = load_language_model(config.model_dir, self.device, self.dtype, config.attention_backend)
        self.model_config = self.model.config
        self.tokenizer = PromptTokenizer(config.model_dir)
        self.fingerprint = model_fingerprint(config.model_dir)
        self.eos_token_ids = frozenset(generation_eos_ids(config.model_dir))
        self.source = embedding_source
        self.runner = ModelRunner(self.model, RunnerConfig(
            config.device, self.dtype, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
            config.num_kv_blocks, config.kv_cache_bytes, config.enforce_eager),
            sorted(self.tokenizer.mm_token_ids))
        self.kv_spec = self.runner.initialize()
        self.inputs = InputProcessor(config, self.model_config, self.tokenizer, self.fingerprint,
                                     self.eos_token_ids, self.kv_spec.num_blocks * self.kv_spec.block_size)
        self.blocks = BlockManager(self.kv_spec.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, config.encoder_max_ahead),
            self.blocks, self.source)
        self._pending: list[RequestOutput] = []  # aborts and failures, reported by the next step
        self._num_finished = self._num_aborted = self._num_failed = 0
        self._ids: set[str] = set()
        self.last_step_num_tokens = 0

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        images: Sequence[ImageLike] = (),
        *,
        messages: list[dict[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        cache_salt: str = "",
    ) -> Request:
        """make_request, then add: validate, tokenize and queue a request (engine thread)."""
        return self.add(self.make_request(request_id, prompt, images, messages=messages, sampling=sampling,
                                          cache_salt=cache_salt))

    def make_request(self, *args: Any, **kwargs: Any) -> Request:
        """InputProcessor.make_request (same arguments): validate, decode and hash images, tokenize.
        Safe on any thread: it reads nothing the engine changes."""
        return self.inputs.make_request(*args, **kwargs)

    def add(self, req: Request) -> Request:
        """Queue a request made by make_request (engine thread). Raises InvalidRequestError for a
        request id in use and QueueFullError when the queue is full."""
        if req.request_id in self._ids:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting")
        self._ids.add(req.request_id)
        if req.detokenizer is None and (self.config.detokenize or req.sampling.stop):
            req.detokenizer = IncrementalDetokenizer(self.tokenizer.tokenizer, req.sampling.stop)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks and embeddings; its ABORT output comes with the next step.

        Like every method here, call it from the thread that calls step(): the engine is not thread-safe.
        """
        req = self.scheduler.get(request_id)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.finish(FinishReason.ABORT)
        self._num_aborted += 1
        self._pending.append(self._final_output(req, [], "", []))
        return True

    def has_unfinished(self) -> bool:
        """True while any request is queued or running, or an output is still to be returned."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of every request that produced tokens or ended."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.last_step_num_tokens = sched.num_batched_tokens  # 0: every request waits (e.g. on images)
        outputs += self._fail(sched)
        if not sched.chunks:
            return outputs
        # Failure boundaries: what goes wrong with one request fails that request (INTERNAL, logged)
        # and the engine steps on. A failed model call fails the step's requests; a device error
        # (torch.AcceleratorError) is not ours to absorb and propagates: the service exits.
        chunks, inputs = [], []
        for chunk in sched.chunks:
            try:
                inputs.append(self._sequence_input(chunk))
                chunks.append(chunk)
            except Exception as exc:  # noqa: BLE001 - a bug or bad state of this request only
                outputs.append(self._fail_request(chunk.request, exc))
        if not chunks:
            return outputs
        try:
            sampled = self.runner.execute(ModelInput(inputs)).sampled
        except _DEVICE_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep the engine
            return outputs + [self._fail_request(c.request, exc) for c in chunks]
        sampling_chunks = [c for c in chunks if c.samples]
        self.scheduler.update_after_step(chunks)
        for chunk, token, lp in zip(sampling_chunks, sampled.token_ids, sampled.logprobs, strict=True):
            try:
                outputs.append(self._append_token(chunk.request, token, lp))
            except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer on this request's text
                outputs.append(self._fail_request(chunk.request, exc))
        return outputs

    def _fail_request(self, req: Request, exc: BaseException) -> RequestOutput:
        """End one request with an internal error, freeing its blocks and embeddings."""
        log.error("request %s failed inside the engine", req.request_id, exc_info=exc)
        if self.scheduler.get(req.request_id) is not None:
            self.scheduler.remove(req)
        self.runner.forget(req.request_id)
        req.finish(FinishReason.ERROR, f"internal error: {type(exc).__name__}")
        self._num_failed += 1
        return self._final_output(req, [], "", [])

    def _sequence_input(self, chunk: ScheduledChunk) -> SequenceInput:
        """What the runner needs of one scheduled chunk."""
        req = chunk.request
        return SequenceInput(
            token_ids=req.token_ids(chunk.start, chunk.end), start=chunk.start,
            block_table=self.blocks.block_table(req), num_prompt_tokens=req.num_prompt_tokens,
            image_rows=self.scheduler.images.rows_for_chunk(req, chunk.start, chunk.end),
            sampling=SamplingRow(req.request_id, req.sampling) if chunk.samples else None)

    def _append_token(self, req: Request, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        """Record a sampled token, detokenize it, and finish the request if a stop condition holds."""
        req.output_token_ids.append(token)
        sp = req.sampling
        detok = req.detokenizer
        text = detok.add([token]) if detok is not None else ""
        reason = None
        if token in sp.stop_token_ids or (token in req.eos_token_ids and not sp.ignore_eos):
            reason = FinishReason.STOP
        elif detok is not None and detok.stopped:
            reason = FinishReason.STOP
        elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.model_config.max_model_len:
            reason = FinishReason.LENGTH
        lps = [lp] if lp is not None else []
        if reason is None:
            return RequestOutput(req.request_id, [token], text, lps)
        if detok is not None:
            text += detok.finish()
        self.scheduler.remove(req)
        self.runner.forget(req.request_id)
        req.finish(reason)
        self._num_finished += 1
        return self._final_output(req, [token], text, lps)

    def _fail(self, sched: SchedulerOutput) -> list[RequestOutput]:
        outs = []
        for req in sched.failed:  # the scheduler already freed their blocks and embeddings
            req.finish(FinishReason.ERROR, req.error)
            self.runner.forget(req.request_id)
            self._num_failed += 1
            out = self._final_output(req, [], "", [])
            out.error_code = self.source.pop_error_code(req.request_id)  # e.g. UNAVAILABLE: the encoder
            outs.append(out)
        return outs

    def _final_output(self, req: Request, tokens: list[int], text: str,
                      lps: list[TokenLogprobs]) -> RequestOutput:
        self._ids.discard(req.request_id)
        usage = Usage(
            prompt_tokens=req.num_prompt_tokens, completion_tokens=len(req.output_token_ids),
            cached_prompt_tokens=max(req.num_cached_tokens, 0), images=len(req.images),
            images_encoder_cache_hits=sum(i.encoder_cache_hit and not i.skipped_by_kv_reuse
                                          for i in req.images),
            images_skipped_by_kv_reuse=sum(i.skipped_by_kv_reuse for i in req.images),
        )
        return RequestOutput(req.request_id, tokens, text, lps, req.finish_reason, usage, req.error)

    # -- introspection ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the counters, not the caches (the service calls it after its warm-up request)."""
        self.scheduler.counters = type(self.scheduler.counters)()
        self.scheduler.images.counters = type(self.scheduler.images.counters)()
        self.blocks.prefix_queried_tokens = self.blocks.prefix_hit_tokens = 0
        self._num_finished = self._num_aborted = self._num_failed = 0

    def stats(self) -> EngineStats:
        """Current state and counters."""
        b, c, i = self.blocks.stats(), self.scheduler.counters, self.scheduler.images.counters
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=b.used_blocks, kv_blocks_total=b.num_blocks,
            kv_cached_free_blocks=b.cached_free_blocks,
            prefix_queried_tokens=b.prefix_queried_tokens, prefix_hit_tokens=b.prefix_hit_tokens,
            images_encoded=i.images_encoded, images_encoder_cache_hits=i.images_encoder_cache_hits,
            images_skipped_by_kv_reuse=i.images_skipped_by_kv_reuse, preemptions=c.preemptions,
            finished=self._num_finished, aborted=self._num_aborted, failed=self._num_failed,
        )

    def generate(self, request_id: str, prompt: str | None = None, images: Sequence[ImageLike] = (),
                 **kwargs: Any) -> RequestOutput:
        """Add one request and step until it finishes; returns its merged output (tests, scripts)."""
        self.add_request(request_id, prompt, images, **kwargs)
        merged = RequestOutput(request_id, [], "")
        while self.has_unfinished():
            for out in self.step():
                if out.request_id != request_id:
                    continue
                merged.new_token_ids += out.new_token_ids
                merged.text += out.text
                merged.logprobs += out.logprobs
                if out.finished:
                    merged.finish_reason, merged.usage, merged.error = out.finish_reason, out.usage, out.error
                    return merged
        return merged

