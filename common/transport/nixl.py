"""NIXL transport: embeddings READ across hosts from the encoder's arena by a transfer engine (UCX).

Encoder side (`NixlExporter`): one agent per encoder process registers the whole arena once (DRAM for
the shm and private arenas; VRAM for a CUDA arena, untested on CPU-only CI) and hands its metadata out
once per decoder, inside the first NIXL ref that decoder gets (EncodeRequest.nixl_agent tells the encoder
which agent the caller has loaded already). Refs carry the slice's address; the lease guards it as for
CUDA IPC: the decoder READs the rows while it holds the lease, then releases it.

Decoder side (`read_slice`): one agent per process, made on the first NIXL ref, with one registered
staging buffer per device (the host's DRAM, or the reader's GPU: a decoder on a GPU READs a GPU
encoder's rows VRAM to VRAM, host rows into host memory, then uploads them);
it loads each encoder's agent once (a restarted encoder's new agent replaces the old), READs the rows
into the staging buffer, checks the transfer until DONE within a deadline, and returns a copy of its own
(on a GPU, finished before the next READ may reuse the buffer). Any failure (no package, unknown agent,
an error or a timeout of the transfer, a dead encoder) raises NixlTransferError: the caller asks for the
bytes instead. A READ never writes the encoder's memory, so a transfer abandoned on a timeout can harm
nothing there; its staging buffer is never reused.

The `nixl` package is optional (`pip install -e '.[nixl]'`) and imported only here, lazily: a wheel for
CUDA 12 (`nixl_cu12`), CUDA 13 (`nixl_cu13`) or the meta package (`nixl`) all do.

Progress: the encoder's agent does not run NIXL's own progress thread (it busy-polls a core); a thread
of ours polls its backend instead, which is what UCX needs on the target side to answer reads that are
not one-sided (over TCP, or staged through host memory): every _PROGRESS_S when idle, every
_BUSY_PROGRESS_S for _BUSY_WINDOW_S after a ref is handed out.

Security: NIXL carries no authentication. Whoever holds an agent's metadata and an address can READ the
registered arena: the data network between encoders and decoders must be trusted, and the gRPC Encode
that hands out descriptors stays the authenticated step. Descriptors travel as plain protobuf fields,
never as NIXL's pickled descriptor lists.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import secrets
import threading
import time

import torch

from common.transport.arena import Arena

log = logging.getLogger("mmserve.transport")

_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # the meta package first: it picks the host's CUDA build
_BACKEND = "UCX"
_PROGRESS_S = 0.002  # the encoder's progress poll when idle: well under a millisecond of CPU per second
# ... and while a READ of a ref it handed out may be in flight: over TCP a 9.8 MB READ took 11 ms polled
# every 50 us, 15-17 ms every 200 us, 20-22 ms every 2 ms (this 2-core VM, bench.nixl_read with
# UCX_TLS=tcp); the fast polls cost the encoder's other threads about a tenth of the GIL while they last.
_BUSY_PROGRESS_S = 0.00005
_BUSY_WINDOW_S = 0.1  # how long after handing out a ref its READ is expected
_READ_TIMEOUT_S = 10.0  # one READ of an embedding takes milliseconds; past this the encoder is gone
_POLL_S = 0.0001  # between checks of a READ in flight


class NixlUnavailableError(RuntimeError):
    """No nixl package, or no UCX backend in it."""


class NixlTransferError(RuntimeError):
    """A NIXL READ could not be set up or did not finish: ask for the bytes instead."""


def nixl_installed() -> bool:
    """True when a nixl package is installed (found, not imported: importing loads UCX)."""
    return any(importlib.util.find_spec(name) is not None for name in _MODULES)


def nixl_module():
    """The nixl API module (nixl_agent, nixl_agent_config); NixlUnavailableError when none is installed."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NixlUnavailableError("no nixl package installed (pip install -e '.[nixl]')")


def _new_agent(name: str):
    # UCX turns off CUDA IPC READs (get zcopy) where it finds no NVLink, e.g. a one-GPU host: a READ of
    # another process's GPU memory then falls back to an emulation over TCP (0.46 GB/s on an H200, against
    # 44 GB/s with it on). Set before UCX starts; a value in the environment wins. Without CUDA, UCX has
    # no such setting (and warns of an unused variable).
    if torch.cuda.is_available():
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    nixl = nixl_module()
    try:
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[_BACKEND]))
    except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
        raise NixlUnavailableError(f"cannot start a NIXL agent: {type(exc).__name__}: {exc}") from None
    if _BACKEND not in agent.backends:
        raise NixlUnavailableError(f"NIXL has no {_BACKEND} backend here")
    return agent


def _mem_type(vram: bool) -> str:
    return "VRAM" if vram else "DRAM"


class NixlExporter:
    """The encoder's agent: the arena registered once, its metadata for decoders, a progress poller."""

    def __init__(self, arena: Arena, name: str | None = None) -> None:
        self.name = name or f"mmserve-enc-{os.getpid()}-{secrets.token_hex(6)}"
        self._agent = _new_agent(self.name)
        whole = arena.view(0, arena.capacity)
        self.vram = whole.device.type == "cuda"
        self.device_id = (whole.device.index or 0) if self.vram else 0
        self.base = whole.data_ptr()
        self.capacity = arena.capacity
        self._whole = whole  # keeps the registered memory alive as long as the registration
        self._reg = self._agent.register_memory([(self.base, self.capacity, self.device_id, "")],
                                                _mem_type(self.vram))
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a ref was handed out: poll fast now
        self._busy_until = 0.0
        self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
        self._thread.start()
        log.info("NIXL agent %s: arena of %d bytes registered (%s)", self.name, self.capacity,
                 _mem_type(self.vram))

    def _progress(self) -> None:
        while not self._stop.is_set():
            busy = time.monotonic() < self._busy_until
            if self._wake.wait(_BUSY_PROGRESS_S if busy else _PROGRESS_S):
                self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._agent.get_new_notifs()  # progresses the backend: connections and reads are served
            except Exception:  # noqa: BLE001 - keep serving; a broken peer is its reader's failure
                log.debug("NIXL progress", exc_info=True)

    def fill(self, loc, offset: int, send_metadata: bool) -> None:
        """Set a NixlLocation message for the slice at offset; its READ is expected soon (fast polls)."""
        self._busy_until = time.monotonic() + _BUSY_WINDOW_S
        self._wake.set()
        loc.agent_name = self.name
        if send_metadata:
            loc.agent_metadata = self.metadata
        loc.address = self.base + offset
        loc.offset = offset
        loc.arena_nbytes = self.capacity
        loc.vram = self.vram
        loc.device_id = self.device_id

    def close(self) -> None:
        """Stop answering reads and deregister the arena (before the arena itself is freed)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # noqa: BLE001 - the process is shutting the arena down anyway
            log.warning("NIXL deregistration failed", exc_info=True)
        self._whole = None


def make_exporter(arena: Arena) -> NixlExporter | None:
    """The arena's NIXL exporter, or None (logged) when NIXL cannot run here."""
    try:
        return NixlExporter(arena)
    except NixlUnavailableError as exc:
        log.warning("NIXL transport not offered: %s", exc)
        return None


class NixlReader:
    """The decoder's agent: remote agents loaded once per encoder, one registered staging buffer per
    device (the host, or a GPU).

    Reads are serialized (one lock): a READ of an embedding takes milliseconds, and one staging buffer
    per device keeps registrations to one per size doubling."""

    def __init__(self) -> None:
        self.name = f"mmserve-dec-{os.getpid()}-{secrets.token_hex(6)}"
        self._agent = _new_agent(self.name)
        self._lock = threading.Lock()
        self._loaded: set[str] = set()  # remote agents whose metadata is loaded
        self._agent_of_source: dict[str, str] = {}
        self._staging: dict[torch.device, tuple[torch.Tensor, object]] = {}  # device -> (buffer, its reg)
        self._abandoned: list[torch.Tensor] = []  # buffers a timed-out READ may still write: never reused
        self.reads = 0
        self.metadata_loads = 0

    def known_agent(self, source: str) -> str:
        """The encoder agent loaded for source (EncodeRequest.nixl_agent), or ""."""
        with self._lock:
            name = self._agent_of_source.get(source, "")
            return name if name in self._loaded else ""

    def _remote(self, loc, source: str | None) -> str:
        name = loc.agent_name
        if name not in self._loaded:
            if not loc.agent_metadata:
                raise NixlTransferError(f"NIXL agent {name!r} is not known here and the ref has no metadata")
            try:
                loaded = self._agent.add_remote_agent(loc.agent_metadata)
            except Exception as exc:  # noqa: BLE001
                raise NixlTransferError(f"cannot load NIXL agent {name!r}: {type(exc).__name__}") from None
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                self._drop(loaded)
                raise NixlTransferError(f"NIXL metadata names agent {loaded!r}, the ref {name!r}")
            self._loaded.add(name)
            self.metadata_loads += 1
        if source is not None:
            old = self._agent_of_source.get(source)
            self._agent_of_source[source] = name
            if old is not None and old != name and old not in self._agent_of_source.values():
                self._drop(old)  # the encoder restarted: its old agent is gone
        return name

    def _drop(self, name: str) -> None:
        self._loaded.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001 - forgetting a dead peer may fail; nothing depends on it
            log.debug("removing NIXL agent %s", name, exc_info=True)

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        staging, reg = self._staging.get(device, (None, None))
        if staging is None or staging.numel() < nbytes:
            if reg is not None:
                self._agent.deregister_memory(reg)
            size = 1 << max(nbytes - 1, 1).bit_length()
            staging = torch.empty(size, dtype=torch.uint8, device=device)
            self._staging[device] = (staging, self._agent.register_memory(staging))
        return staging

    def _abandon(self, device: torch.device) -> None:
        """Never reuse the device's staging buffer: a READ still in flight may write it later."""
        staging, _ = self._staging.pop(device, (None, None))
        if staging is not None:
            self._abandoned.append(staging)

    def read(self, loc, nbytes: int, source: str | None = None, device: torch.device | None = None,
             timeout_s: float = _READ_TIMEOUT_S) -> torch.Tensor:
        """A uint8 tensor of our own with [loc.address, + nbytes) of the encoder's arena, on device's GPU
        when it is one (the copy out of the staging buffer runs on the current stream and is finished
        when this returns), else on the host."""
        if loc.offset + nbytes > loc.arena_nbytes:
            raise ValueError("slice past the end of the NIXL arena")
        on_gpu = device is not None and device.type == "cuda"
        where = torch.device("cpu")
        if on_gpu and loc.vram:  # VRAM to VRAM; host rows come to host memory first (UCX's fast path)
            index = torch.cuda.current_device() if device.index is None else device.index
            where = torch.device("cuda", index)
        with self._lock:
            name = self._remote(loc, source)
            staging = self._buffer(nbytes, where)
            try:
                local = self._agent.get_xfer_descs([(staging.data_ptr(), nbytes, where.index or 0)],
                                                   _mem_type(where.type == "cuda"))
                remote = self._agent.get_xfer_descs([(loc.address, nbytes, loc.device_id)],
                                                    _mem_type(loc.vram))
                handle = self._agent.initialize_xfer("READ", local, remote, name)
            except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
                self._drop(name)  # fetch its metadata afresh next time
                raise NixlTransferError(
                    f"NIXL READ from {name!r} refused: {type(exc).__name__}: {exc}") from None
            state = "PROC"
            try:
                state = self._agent.transfer(handle)
                deadline = time.monotonic() + timeout_s
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise NixlTransferError(f"NIXL READ from {name!r} not done within {timeout_s:g} s")
                    time.sleep(_POLL_S)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlTransferError(f"NIXL READ from {name!r} failed ({state})")
            except NixlTransferError:
                self._drop(name)
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. the remote agent disconnected (dead encoder)
                self._drop(name)
                raise NixlTransferError(
                    f"NIXL READ from {name!r} failed: {type(exc).__name__}: {exc}") from None
            finally:
                if state not in ("DONE", "ERR"):  # may still be in flight (a timeout, a broken check)
                    self._abandon(where)
                try:
                    handle.release()
                except Exception:  # noqa: BLE001 - a handle of a failed READ may refuse release
                    log.debug("releasing a NIXL transfer handle", exc_info=True)
            self.reads += 1
            if on_gpu:  # the copy is queued on a stream: done before the next READ writes the buffer
                out = staging[:nbytes].to(device, copy=True)
                torch.cuda.current_stream(out.device).synchronize()
                return out
            return staging[:nbytes].clone()


_reader: NixlReader | None = None
_reader_lock = threading.Lock()


def reader() -> NixlReader:
    """This process's reader, made on first use (NixlTransferError when NIXL cannot run here)."""
    global _reader
    with _reader_lock:
        if _reader is None:
            try:
                _reader = NixlReader()
            except NixlUnavailableError as exc:
                raise NixlTransferError(str(exc)) from None
        return _reader


def start_reader() -> bool:
    """Make this process's reader now, at start-up: its agent takes about half a second to start (UCX),
    which would otherwise fall on the first request read over NIXL. False (logged) when NIXL cannot run
    here; reads then fall back to the bytes as they would anyway."""
    try:
        reader()
        return True
    except NixlTransferError as exc:
        log.warning("NIXL reader not started: %s", exc)
        return False


def known_agent(source: str) -> str:
    """The encoder agent this process has loaded for source, or "" (never starts NIXL)."""
    return _reader.known_agent(source) if _reader is not None else ""


def read_slice(loc, nbytes: int, source: str | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
    """READ a NixlLocation's nbytes into a new uint8 tensor (on device's GPU when it is one, else host)."""
    return reader().read(loc, nbytes, source, torch.device(device) if device is not None else None)
