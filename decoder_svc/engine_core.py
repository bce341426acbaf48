"""The engine core: the LLMEngine stepping in a process of its own, away from the gRPC front end.

Why a process: on a thread beside the grpc.aio server, every token's delivery, detokenization and
protobuf work takes the GIL from the engine between its steps, and the GPU waits (BENCHMARKS.md has the
measurements). In its own process the core's only serving work is one pickled message of outputs per
step.

The front end (core_client.EngineCoreClient) talks to it over one multiprocessing pipe, in the messages
of core_protocol.py. The core stops when told, or when the pipe breaks (the front end is gone): it never
outlives it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import socket
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

from common.checkpoint import CheckpointError
from common.freed_memory import release_freed_memory, reuse_freed_blocks
from common.memory_return import TRIM_IDLE_BYTES
from common.security.options import ClientSecurity
from common.server import configure_logging
from common.startup import dump_stacks_on_signal
from decoder_svc import core_protocol as msg
from decoder_svc.config import DecoderConfig
from decoder_svc.core_pipe import MessageReader
from decoder_svc.engine.config import EngineConfig
from decoder_svc.engine.engine import LLMEngine
from decoder_svc.engine.following_bytes import FollowingBytes, awaiting_files
from decoder_svc.engine.sampling_params import InvalidRequestError
from decoder_svc.engine.warm_up import WarmUpError, warm_up
from decoder_svc.model.lora.adapter import LoRAError
from decoder_svc.stats import DecoderStats
from decoder_svc.step_trace import StepRecord, StepTrace, now

log = logging.getLogger("mmserve.decoder.core")

_IDLE_WAIT_S = 0.5       # nothing to do: sleep until a command arrives
_WAITING_POLL_S = 0.002  # requests wait on the encoder: poll again soon, without spinning a core


class Wakeup:
    """A socket pair the embedding source's threads poke when an embedding arrives or fails: the loop
    waits on it beside the pipe, so a request whose image just came is scheduled now, not at the next
    poll."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def set(self) -> None:
        """Wake the loop (any thread; a wake already pending is enough)."""
        try:
            self._writer.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def clear(self) -> None:
        """Drain the pokes received so far."""
        try:
            while self.reader.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close both ends."""
        self.reader.close()
        self._writer.close()


def engine_config(config: DecoderConfig) -> EngineConfig:
    """The engine's configuration in the core: the front end detokenizes, the core only for stop
    strings."""
    return dataclasses.replace(config.engine, detokenize=False)


def build_engine(config: DecoderConfig, encoder_link: ClientSecurity, lease_owner: str | None = None
                 ) -> LLMEngine:
    """The engine with a remote embedding source over the configured encoders; its leases are taken
    for `lease_owner` (None: a fresh secret), which the front end can then release if the core dies."""
    from common.transport import nixl
    from common.transport.importer import accepted_transports
    from decoder_svc.encoders.discovery import EncoderPool, GrpcHealthCheck
    from decoder_svc.encoders.remote_source import RemoteEmbeddingSource, RetryPolicy

    pool = EncoderPool(config.encoders.addresses, interval_s=config.encoders.resolve_interval_s,
                       health_check=GrpcHealthCheck(tls=encoder_link.tls))
    transports = accepted_transports(config.encoders.transport_list, config.engine.device)
    if "nixl" in (config.encoders.transport_list or ()):  # asked for by name: NIXL is how it will read
        nixl.start_reader()  # its agent's start-up (~0.5 s) is then not the first NIXL request's
    source = RemoteEmbeddingSource(pool, device=config.engine.device, transports=transports,
                                   retry=RetryPolicy(total_timeout_s=config.encoders.timeout_s),
                                   tls=encoder_link.tls, token=encoder_link.token, lease_owner=lease_owner,
                                   retain_bytes=config.encoders.retain_bytes)
    return LLMEngine(engine_config(config), embedding_source=source)


class _FrontEndGone:
    """The pipe broke: what the command reader leaves in the inbox for the loop."""


class EngineCore:
    """The core's loop: commands in, steps, outputs out.

    A reader thread takes commands off the pipe while the loop steps, so a request's crossing (its image
    bytes, megabytes) overlaps the GPU's work instead of waiting for the step to end, and every command
    that arrived during a step is handled before the next one.
    """

    def __init__(self, engine: LLMEngine, conn: Connection, trace: StepTrace | None = None) -> None:
        self.engine = engine
        self.conn = conn
        self.trace = trace
        self._commands = 0  # handled since the last step (the trace's)
        self._idle = 0.0  # seconds waited for work since the last step (the trace's)
        self._closed = False
        self.wakeup = Wakeup()
        engine.source.on_change = self.wakeup.set
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Image files read off the pipe since memory was last given back, and the times it was: a flood
        # of 7 MB files leaves hundreds of MB free in glibc's arenas, given back once the engine is idle.
        self.file_bytes_since_trim = 0
        self.trims = 0
        threading.Thread(target=self._receive, name="core-commands", daemon=True).start()

    def _receive(self) -> None:
        """The reader thread: every message into the inbox, then a poke of the loop; a request's image
        files go straight into its placeholders (they come right after it)."""
        awaiting: dict[str, list[FollowingBytes]] = {}
        reader = MessageReader(self.conn)
        try:
            while True:
                message = reader.recv()
                if isinstance(message, msg.ImageBytes):
                    self.file_bytes_since_trim += sum(len(f) for f in message.files if f)
                    holders = awaiting.pop(message.request_id, [])
                    for holder, data in zip(holders, message.files, strict=False):
                        holder.set(data)
                    continue
                if isinstance(message, msg.AddRequest):
                    message.request.times.arrived = time.monotonic()
                    holders = awaiting_files(message.request.images)
                    if holders:
                        awaiting[message.request.request_id] = holders
                self._inbox.put(message)
                self.wakeup.set()
                if isinstance(message, msg.Close):
                    return
        except (EOFError, OSError):
            self._inbox.put(_FrontEndGone())
            self.wakeup.set()
        finally:
            reader.close()

    def _call(self, call: msg.CoreCall) -> Any:
        engine = self.engine
        if isinstance(call, msg.AddRequest):
            engine.add(call.request)  # the Request lives here now; the front end needs nothing back
            return None
        if isinstance(call, msg.AbortRequest):
            return engine.abort(call.request_id)
        if isinstance(call, msg.GetStats):
            return DecoderStats(engine.stats(), engine.source.stats())
        raise TypeError(f"unknown engine core call {type(call).__name__}")

    def _run_commands(self, timeout: float) -> None:
        """Wait up to timeout for a command or an embedding's arrival, then handle every command in."""
        if self._inbox.empty() and timeout > 0:
            waited = now()
            wait([self.wakeup.reader], timeout)
            self._idle += now() - waited
        self.wakeup.clear()  # before draining: a command put after this pokes the next wait
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _FrontEndGone):
                raise EOFError("the front end is gone")
            if isinstance(message, msg.Close):
                self._closed = True
                return
            self._commands += 1
            try:
                reply = msg.Reply(message.token, True, self._call(message))
            except Exception as exc:  # noqa: BLE001 - the caller's error (a duplicate id, a full queue)
                reply = msg.Reply(message.token, False, exc)
            self.conn.send(reply)

    def run(self) -> None:
        """Serve until told to close or the pipe breaks."""
        engine = self.engine
        progressed = False
        while not self._closed:
            if not engine.has_unfinished():
                timeout = _IDLE_WAIT_S
                if self.file_bytes_since_trim >= TRIM_IDLE_BYTES:  # a burst of files is over
                    self.file_bytes_since_trim = 0
                    self.trims += release_freed_memory()
            else:  # a step that computed nothing waits on the encoder: don't spin a core on it
                timeout = 0.0 if progressed else _WAITING_POLL_S
            self._run_commands(timeout)
            if self._closed or not engine.has_unfinished():
                progressed = False
                continue
            started = now()
            outputs = engine.step()
            seconds = now() - started
            progressed = engine.last_step_num_tokens > 0 or bool(outputs)
            if outputs:
                self.conn.send(msg.StepOutputs(outputs, seconds))
            if self.trace is not None:
                self._trace_step(started, seconds, outputs)

    def _trace_step(self, started: float, seconds: float, outputs: list) -> None:
        shape, scheduler = self.engine.last_step, self.engine.scheduler
        self.trace.write(StepRecord(
            t=started, s=seconds, tokens=shape.num_tokens, prefill=shape.prefill_chunks,
            decode=shape.decode_chunks, sampled=sum(o.times is not None for o in outputs),
            running=len(scheduler.running), waiting=len(scheduler.waiting), commands=self._commands,
            idle=self._idle, received=[o.times.received for o in outputs if o.times is not None],
            prefilled=[list(c) for c in shape.prompt_chunks()],
            firsts=[[o.request_id, o.times.received, o.times.added, o.times.images_ready]
                    for o in outputs if o.times is not None]))
        self._commands, self._idle = 0, 0.0


def run_core(conn: Connection, config: DecoderConfig, encoder_link: ClientSecurity,
             lease_owner: str | None = None) -> None:
    """The core process's entry point (multiprocessing target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end decides
    configure_logging(config.service.log_level)
    reuse_freed_blocks()  # image bytes follow their requests through the pipe, megabytes each
    dump_stacks_on_signal()
    try:
        engine = build_engine(config, encoder_link, lease_owner)
    except LoRAError as exc:  # an adapter we cannot serve: one line, exit 2
        conn.send(msg.StartRefused(f"--lora-modules: {exc}"))
        return
    except CheckpointError as exc:  # a configuration we cannot serve: one line, exit 2
        conn.send(msg.StartRefused(f"--model: {config.engine.model}: {exc}"))
        return
    except BaseException:  # noqa: BLE001 - reported to the front end, which exits with it
        conn.send(msg.StartFailed(traceback.format_exc()))
        return
    try:
        try:
            warm_up(engine, full=engine.config.full_warm_up)
        except InvalidRequestError as exc:
            conn.send(msg.StartRefused(f"the warm-up request does not fit: {exc}; give more --num-kv-blocks "
                                   "or --kv-cache-bytes, or a smaller --max-tokens-default"))
            return
        except WarmUpError:
            conn.send(msg.StartFailed(traceback.format_exc()))
            return
        spec = engine.kv_spec
        info = msg.CoreInfo(spec.num_blocks * spec.block_size, spec.num_blocks, spec.block_size)
        conn.send(msg.Ready(info))
        try:
            trace = StepTrace(config.step_trace) if config.step_trace else None
            core = EngineCore(engine, conn, trace)
            try:
                core.run()
            finally:
                core.wakeup.close()
                if trace is not None:
                    trace.close()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            log.info("front end gone: engine core stopping")
        except BaseException as exc:
            log.exception("engine core died")
            try:
                conn.send(msg.Died(f"{type(exc).__name__}: {exc}"))
            finally:
                raise SystemExit(1) from None
    finally:
        engine.source.close()
