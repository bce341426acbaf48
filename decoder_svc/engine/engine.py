"""LLMEngine: the in-process decoder. Each step is three calls and a translation:

    scheduler.schedule() -> runner.launch(model input) -> scheduler.update_from_output() -> outputs

The scheduler owns request state; the runner sees plain sequences (runner/inputs.py); the output
processor turns the scheduler's updates into RequestOutputs. Input processing (validation, images,
tokenization) happens before a request reaches the engine (engine/input_processor.py).

With asynchronous scheduling (on by default on a single GPU) a step launches the next batch before it
reads the previous one's sampled tokens: the host's work between steps (scheduling, inputs, outputs, the
core's messages) then overlaps the GPU's, instead of leaving it idle. Outputs come one step later."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from common.checkpoint import model_fingerprint, parse_dtype
from common.errors import CapacityError
from common.stats import stat
from decoder_svc.engine.config import EngineConfig
from decoder_svc.engine.embedding_source import EmbeddingSource
from decoder_svc.engine.input_processor import InputProcessor
from decoder_svc.engine.kv_cache_manager import KVCacheManager, KvGroupStats
from decoder_svc.engine.new_request import ImageLike, NewRequest
from decoder_svc.engine.output_processor import OutputProcessor, RequestOutput
from decoder_svc.engine.request import FinishReason, Request
from decoder_svc.engine.sampling_params import InvalidRequestError
from decoder_svc.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from decoder_svc.model import generation_eos_ids, load_language_model
from decoder_svc.model.linear_state import LinearStatePool
from decoder_svc.model.parallel import TensorParallel
from decoder_svc.runner import ModelInput, ModelOutput, ModelRunner, RunnerConfig, SamplingRow, SequenceInput
from decoder_svc.runner.inputs import PENDING_TOKEN
from decoder_svc.runner.model_runner import LaunchedStep
from decoder_svc.runner.tensor_parallel import TensorParallelGroup, TensorParallelRunner, rank_device
from decoder_svc.tokenization import PromptTokenizer

log = logging.getLogger("mmserve.decoder.engine")
# Errors that leave the device unusable: the engine cannot absorb them (torch < 2.8 lacks the class).
_DEVICE_ERRORS = tuple(c for c in (getattr(torch, "AcceleratorError", None),) if c is not None)



class _Done:
    """A step the runner computed in one call (synchronous scheduling)."""

    def __init__(self, output: ModelOutput) -> None:
        self._output = output

    def result(self) -> ModelOutput:
        """The step's output."""
        return self._output


class QueueFullError(CapacityError):
    """Too many requests waiting (the service answers RESOURCE_EXHAUSTED)."""


@dataclass
class EngineStats:
    """A snapshot of the engine's state and counters (names as in the API's DecoderStats)."""

    running: int = stat("Running requests", "gauge")
    waiting: int = stat("Waiting requests", "gauge")
    kv_blocks_used: int = stat("KV blocks held by requests", "gauge")
    kv_blocks_total: int = stat("KV blocks in the pool", "gauge")
    kv_blocks_cached_free: int = stat("Free KV blocks that still hold reusable prefix KV", "gauge")
    prefix_cache_queried_tokens: int = stat("Prompt tokens looked up in the prefix cache")
    prefix_cache_hit_tokens: int = stat("Prompt tokens found in the prefix cache")
    prefix_cache_hit_tokens_by_adapter: dict = stat(
        "Prompt tokens found in the prefix cache, by LoRA adapter (\"\": the base model)", "labels",
        label="adapter")
    images_encoded: int = stat("Images whose embedding was computed by an encoder's tower for us")
    images_encoder_cache_hits: int = stat("Images served from an encoder's cache")
    images_skipped_by_kv_reuse: int = stat("Images never fetched because their KV was cached")
    preemptions: int = stat("Requests preempted (recomputed later)")
    requests_finished: int = stat("Requests ended by a stop condition or their length")
    requests_aborted: int = stat("Requests aborted (client cancel, deadline, disconnect)")
    requests_failed: int = stat("Requests ended by an error")
    samples_forked: int = stat("Samples of an n > 1 request that started from its prefilled prompt KV")
    samples_queued: int = stat("Samples of an n > 1 request queued as requests of their own (no KV shared)")
    state_slots_used: int = stat("Linear-attention state slots held by requests (hybrid models)", "gauge")
    state_slots_total: int = stat("Linear-attention state slots (hybrid models; 0 for others)", "gauge")
    state_snapshots_held: int = stat("Linear-attention state snapshots kept for prefix reuse", "gauge")
    state_snapshot_bytes: int = stat("Bytes of the linear-attention state snapshots kept", "gauge")
    state_snapshot_hits: int = stat("Admissions that resumed a prefix from a state snapshot")
    state_snapshots_taken: int = stat("Linear-attention state snapshots written")
    state_snapshot_evictions: int = stat("Linear-attention state snapshots dropped for newer ones (LRU)")
    kv_groups: list[KvGroupStats] = stat("KV cache blocks per group of layers with one attention pattern",
                                         "rows", label="group")


@dataclass
class InFlightStep:
    """A launched step: what was scheduled (chunks that could not be built removed) and its handle."""

    scheduled: SchedulerOutput
    launched: LaunchedStep | _Done
    started: float


@dataclass
class StepShape:
    """What the last step computed: tokens, and chunks of more than one token (prefill) or one (decode);
    `chunks` are the step's own (the step trace reads them; kept, not copied)."""

    num_tokens: int = 0
    prefill_chunks: int = 0
    decode_chunks: int = 0
    chunks: list[ScheduledChunk] = field(default_factory=list)

    def prompt_chunks(self) -> list[tuple[str, int, int]]:
        """(request id, start, tokens) of each chunk inside its request's prompt."""
        return [(c.request.request_id, c.start, c.num_tokens) for c in self.chunks
                if c.start < c.request.num_prompt_tokens]


class LLMEngine:
    """Continuous-batching generation over our paged-KV language model."""

    def __init__(self, config: EngineConfig, embedding_source: EmbeddingSource) -> None:
        """An engine over `embedding_source`: a remote one (decoder_svc.encoders.remote_source) in the
        service, LocalEmbeddingSource.for_engine(config) in-process."""
        if config.async_scheduling == "on" and config.tensor_parallel_size > 1:
            raise ValueError("--async-scheduling on needs --tensor-parallel-size 1")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = parse_dtype(config.dtype)
        self.tokenizer = PromptTokenizer(config.model)
        mm_token_ids = sorted(self.tokenizer.mm_token_ids)
        self.tp_group: TensorParallelGroup | None = None
        tp = None
        if config.tensor_parallel_size > 1:
            # The workers load their shards while this process loads its own (rank 0's).
            self.tp_group = TensorParallelGroup(config, mm_token_ids)
            tp = TensorParallel(0, config.tensor_parallel_size)
            self.device = torch.device(rank_device(config.device, 0))
        try:
            self.model = load_language_model(config.model, self.device, self.dtype, config.attention_backend,
                                             config.quantization, config.load_format, tp=tp,
                                             lora_modules=config.lora_adapters,
                                             deterministic=config.deterministic,
                                             merge_builtin_adapter=config.merge_builtin_adapter)
            # Adapter i of --lora-modules, then the checkpoint's own, runs in LoRA slot i + 1 (model/lora/);
            # "" is the base model's 0.
            self.lora_slots = {"": 0} | {name: i for i, name in enumerate(config.served_adapters, 1)}
            self.model_config = self.model.config
            self.fingerprint = model_fingerprint(config.model)
            self.eos_token_ids = frozenset(generation_eos_ids(config.model))
            # Tensor-parallel steps run eagerly: graphs with collectives inside are not done yet.
            runner_config = RunnerConfig.for_engine(config, str(self.device), self.dtype,
                                                    self.tokenizer.layout, eager=tp is not None)
            runner = ModelRunner(self.model, runner_config, mm_token_ids)
            self.runner = runner if self.tp_group is None else TensorParallelRunner(runner, self.tp_group)
            self.kv_spec = self.runner.initialize()
        except BaseException:
            self.close()
            raise
        self.inputs = InputProcessor(config, self.model_config, self.tokenizer, self.fingerprint,
                                     self.eos_token_ids, self.kv_spec.num_blocks * self.kv_spec.block_size)
        hybrid = bool(self.model_config.linear_layers)
        self.blocks = KVCacheManager.for_groups(
            self.kv_spec.pools, config.block_size, config.enable_prefix_caching,
            runner_config.state_slots if hybrid else 0, runner_config.num_state_snapshots,
            config.state_snapshot_interval, LinearStatePool.bytes_per_slot(self.model_config, self.dtype))
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, config.encoder_max_ahead,
                            self.model_config.max_model_len, self.tokenizer.layout.bidirectional_images),
            self.blocks, embedding_source)
        self.outputs = OutputProcessor(self.tokenizer.tokenizer, config.detokenize)
        self.last_step = StepShape()
        self.async_scheduling = self._resolve_async(config.async_scheduling)
        self._in_flight: InFlightStep | None = None

    def _resolve_async(self, mode: str) -> bool:
        # Tensor-parallel steps broadcast each batch to the workers in one call: no launch-only form yet.
        return mode == "on" or (mode == "auto" and self.device.type == "cuda" and self.tp_group is None)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; a single-device engine holds nothing)."""
        if self.tp_group is not None:
            self.tp_group.close()

    @property
    def source(self) -> EmbeddingSource:
        """The embedding source; the scheduler's image bookkeeping holds it, the only reference."""
        return self.scheduler.images.source

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None, images: Sequence[ImageLike] = (),
                    **fields: Any) -> Request:
        """Validate, tokenize and queue a request (engine thread): `self.inputs.make` of
        NewRequest(request_id, prompt, images, **fields), then `add`. The service makes requests on its
        own threads and calls `add` only."""
        return self.add(self.inputs.make(NewRequest(request_id, prompt, images, **fields)))

    def add(self, req: Request) -> Request:
        """Queue a request made by InputProcessor.make_request (engine thread). Raises
        InvalidRequestError for a request id in use and QueueFullError when the queue is full."""
        if req.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are already waiting")
        for queued in self.scheduler.add(req):  # n samples that cannot share its KV: all of them
            self.outputs.add_request(queued)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sample of it) and free its blocks and embeddings; the ABORT outputs
        come with the next step.

        Like every method here, call it from the thread that calls step(): the engine is not thread-safe.
        """
        live = self.scheduler.live_samples(request_id)
        for req in live:
            self.scheduler.finish_request(req, FinishReason.ABORT)
        return bool(live)

    def has_unfinished(self) -> bool:
        """True while any request is queued or running, or an output is still to be returned."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Launch one batch; return the outputs of every request that produced tokens or ended: of this
        batch, or with asynchronous scheduling of the one launched before it."""
        scheduled = self.scheduler.schedule()
        for child in scheduled.forked:
            self.outputs.add_request(child)
        decodes = sum(c.num_tokens == 1 for c in scheduled.chunks)
        self.last_step = StepShape(scheduled.num_batched_tokens, len(scheduled.chunks) - decodes, decodes,
                                   scheduled.chunks)
        step = self._launch(scheduled)
        if self.async_scheduling:
            step, self._in_flight = self._in_flight, step
        return self._finish(step)

    def _launch(self, scheduled: SchedulerOutput) -> InFlightStep | None:
        """The runner's step over the scheduled chunks, queued on the device; None when nothing is
        computed (or the launch failed).

        Failure boundaries: what goes wrong with one request fails that request (INTERNAL, logged) and
        the engine steps on. A failed model call fails the step's requests; a device error
        (torch.AcceleratorError) is not ours to absorb and propagates: the service exits.
        """
        started = time.monotonic()
        sequences, built = [], []
        for chunk in scheduled.chunks:
            try:
                sequences.append(self._sequence_input(chunk))
                built.append(chunk)
            except Exception as exc:  # noqa: BLE001 - a bug or bad state of this request only
                self._fail(chunk.request, exc)
        scheduled.chunks = built  # what the runner's sampled rows line up with
        batch = ModelInput(sequences, scheduled.finished_request_ids, scheduled.block_copies,
                           self.blocks.take_state_copies())
        run = self.runner
        try:  # synchronous: the runner's one-call form (the only one tensor parallelism has)
            launched = run.launch(batch) if self.async_scheduling else _Done(run.execute(batch))
        except _DEVICE_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep the engine
            self.blocks.step_launched(ok=False)
            self._fail_batch(scheduled, exc)  # reported with the next update
            return None
        self.blocks.step_launched(ok=True)
        return InFlightStep(scheduled, launched, started) if sequences else None

    def _finish(self, step: InFlightStep | None) -> list[RequestOutput]:
        """Read a launched step's tokens and take them in; outputs for every request with news."""
        output = None
        if step is not None:
            try:
                output = step.launched.result()
            except _DEVICE_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep the engine
                self._fail_batch(step.scheduled, exc)
        updates = self.scheduler.update_from_output(step.scheduled if step else SchedulerOutput(), output)
        if step is not None:
            ended = time.monotonic()
            for update in updates:  # a first token: this step finished the prompt (ttft_stages.py)
                req = update.request
                if update.new_token_ids and len(req.output_token_ids) == len(update.new_token_ids):
                    req.times.step_started, req.times.sampled = step.started, ended
        return self.outputs.process(updates, self.scheduler)

    def _fail_batch(self, scheduled: SchedulerOutput, exc: BaseException) -> None:
        for chunk in scheduled.chunks:
            self._fail(chunk.request, exc)

    def _fail(self, req: Request, exc: BaseException) -> None:
        """End one request with an internal error (logged with its traceback)."""
        if req.is_finished:
            return
        log.error("request %s failed inside the engine", req.request_id, exc_info=exc)
        self.scheduler.finish_request(req, FinishReason.ERROR, f"internal error: {type(exc).__name__}")

    def _sequence_input(self, chunk: ScheduledChunk) -> SequenceInput:
        """What the runner needs of one scheduled chunk."""
        req = chunk.request
        token_ids = req.token_ids(chunk.start, chunk.end)
        if len(token_ids) < chunk.num_tokens:  # the last one is sampled by the step in flight
            token_ids.extend([PENDING_TOKEN] * (chunk.num_tokens - len(token_ids)))
        table, *group_tables = self.blocks.block_tables(req)
        return SequenceInput(
            token_ids=token_ids, start=chunk.start, block_table=table, group_tables=group_tables,
            num_prompt_tokens=req.num_prompt_tokens,
            image_rows=self.scheduler.images.rows_for_chunk(req, chunk.start, chunk.end),
            sampling=SamplingRow(req.request_id, req.sampling) if chunk.samples else None,
            mrope_positions=req.mrope_positions, mrope_delta=req.mrope_delta,
            lora_slot=self.lora_slots[req.lora_adapter], state_slot=self.blocks.state_slot(req),
            # last: it reserves snapshot slots that this chunk's forward must write
            state_snapshots=self.blocks.snapshot_points(req, chunk.start, chunk.end))

    # -- introspection ---------------------------------------------------------------------------
    @property
    def last_step_num_tokens(self) -> int:
        """Tokens the last step computed (0: every request waited, e.g. on images)."""
        return self.last_step.num_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (KV blocks, state snapshots); False, changing nothing, while a
        request is running or queued."""
        return not self.has_unfinished() and self.blocks.reset_prefix_cache()

    def reset_stats(self) -> None:
        """Zero the counters, not the caches (the service calls it after its warm-up request)."""
        self.scheduler.counters = type(self.scheduler.counters)()
        self.scheduler.images.counters = type(self.scheduler.images.counters)()
        self.blocks.prefix_queried_tokens = self.blocks.prefix_hit_tokens = 0
        self.blocks.prefix_hit_tokens_by_adapter = {}
        if self.blocks.snapshots is not None:
            self.blocks.snapshots.counters = type(self.blocks.snapshots.counters)()

    def stats(self) -> EngineStats:
        """Current state and counters."""
        b, c, i = self.blocks.stats(), self.scheduler.counters, self.scheduler.images.counters
        slots, snaps = self.blocks.state_slots, self.blocks.snapshots
        counts = snaps.counters if snaps is not None else None
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_blocks_used=b.used_blocks, kv_blocks_total=b.num_blocks,
            kv_blocks_cached_free=b.cached_free_blocks, prefix_cache_queried_tokens=b.prefix_queried_tokens,
            prefix_cache_hit_tokens=b.prefix_hit_tokens,
            prefix_cache_hit_tokens_by_adapter=dict(self.blocks.prefix_hit_tokens_by_adapter),
            images_encoded=i.images_encoded, images_encoder_cache_hits=i.images_encoder_cache_hits,
            images_skipped_by_kv_reuse=i.images_skipped_by_kv_reuse, preemptions=c.preemptions,
            requests_finished=c.finished, requests_aborted=c.aborted, requests_failed=c.failed,
            samples_forked=c.forked_in_kv, samples_queued=c.forked_queued,
            state_slots_used=slots.num_used if slots is not None else 0,
            state_slots_total=slots.num_slots if slots is not None else 0,
            state_snapshots_held=snaps.num_held if snaps is not None else 0,
            state_snapshot_bytes=snaps.bytes_held if snaps is not None else 0,
            state_snapshot_hits=counts.hits if counts is not None else 0,
            state_snapshots_taken=counts.taken if counts is not None else 0,
            state_snapshot_evictions=counts.evictions if counts is not None else 0,
            kv_groups=self.blocks.group_rows(),
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

