"""GPU arena shared by CUDA IPC: one cupy `runtime.malloc` buffer per encoder, its handle exported once.

Why cupy and not a torch tensor: torch's caching allocator hands out sub-blocks of larger segments and,
with expandable segments, memory that legacy IPC handles cannot export; a raw cudaMalloc has one handle
for the whole buffer and no ref-count files. cupy is imported lazily: CPU installs do not have it.

Readers open each arena handle once per process (opening costs ~0.1 s the first time) and wrap slices
as torch tensors with no copy. Each entry carries an interprocess event recorded on the producer's
stream after its write; a reader makes its current stream wait on it, so it never sees stale bytes.

A restarted encoder exports a new handle, so the reader's cache (keyed by handle) maps it afresh.
`forget_arena` drops the old one: its IPC mapping is closed once the last view over it is collected,
which lets the driver free a dead encoder's memory.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from common.transport.arena import Arena

log = logging.getLogger("mmserve.transport")


def _cupy():
    import cupy  # noqa: PLC0415 - lazily: only GPU hosts have cupy

    return cupy


def cuda_ipc_available() -> bool:
    """True when this process has a CUDA device and cupy."""
    if not torch.cuda.is_available():
        return False
    try:
        _cupy()
    except Exception:
        return False
    return True


def _norm_uuid(raw) -> str:
    if isinstance(raw, (bytes, bytearray)):
        return bytes(raw).hex()
    text = str(raw).lower().removeprefix("gpu-").replace("-", "")
    return text


def device_uuid(index: int) -> str:
    """The physical GPU's UUID as 32 hex digits (stable across CUDA_VISIBLE_DEVICES orderings)."""
    props = torch.cuda.get_device_properties(index)
    raw = getattr(props, "uuid", None)
    if raw is None:  # very old torch: ask the runtime through cupy
        raw = _cupy().cuda.runtime.getDeviceProperties(index)["uuid"]
    return _norm_uuid(raw)


def local_device_index(uuid: str) -> int | None:
    """Index of the visible device with this UUID, or None when it is not visible here."""
    if not uuid or not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


class _DevicePtr:
    """A raw device range presented through __cuda_array_interface__ so torch can view it."""

    def __init__(self, ptr: int, nbytes: int, owner=None) -> None:
        self._owner = owner  # keeps the allocation or IPC mapping alive while a view exists
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None,
        }


def view_device_ptr(ptr: int, nbytes: int, device: torch.device, owner=None) -> torch.Tensor:
    """A uint8 torch tensor over [ptr, ptr + nbytes) on device, with no copy."""
    with torch.cuda.device(device):
        return torch.as_tensor(_DevicePtr(ptr, nbytes, owner), device=device)


class CudaArena(Arena):
    """The producer's GPU arena: cudaMalloc'd once, IPC handle exported once."""

    def __init__(self, capacity: int, device: torch.device | str = "cuda") -> None:
        cp = _cupy()
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.capacity = capacity
        with cp.cuda.Device(self.device.index):
            self._ptr = cp.cuda.runtime.malloc(capacity)
            self.mem_handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._ptr))
        self.device_uuid = device_uuid(self.device.index)
        self._buf = view_device_ptr(self._ptr, capacity, self.device)
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        self._buf = None
        cp = _cupy()
        with cp.cuda.Device(self.device.index):
            cp.cuda.runtime.free(self._ptr)


def new_producer_event() -> torch.cuda.Event:
    """An event other processes can wait on (interprocess events cannot time)."""
    return torch.cuda.Event(interprocess=True, enable_timing=False)


@dataclass
class _Opened:
    ptr: int
    device: torch.device
    nbytes: int


_opened: dict[bytes, _Opened] = {}
_opened_lock = threading.Lock()
cuda_opens = 0  # arena handles opened by this process (tests check: once per arena)
cuda_closes = 0  # IPC mappings closed again (after forget_arena and the last view's collection)


def _close_mapping(ptr: int, device_index: int) -> None:
    """Finalizer of an _Opened: runs once neither the cache nor any view refers to it."""
    global cuda_closes
    try:
        cp = _cupy()
        with cp.cuda.Device(device_index):
            # Kernels queued on a view just collected may still read the mapping: let them finish.
            cp.cuda.runtime.deviceSynchronize()
            cp.cuda.runtime.ipcCloseMemHandle(ptr)
        cuda_closes += 1
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the mapping leaks until exit
        log.warning("closing a CUDA IPC mapping failed", exc_info=True)


def open_arena(mem_handle: bytes, device_index: int, arena_nbytes: int) -> _Opened:
    """Map another process's arena once per process; later calls return the cached mapping."""
    global cuda_opens
    with _opened_lock:
        hit = _opened.get(mem_handle)
        if hit is not None:
            return hit
        cp = _cupy()
        with cp.cuda.Device(device_index):
            ptr = cp.cuda.runtime.ipcOpenMemHandle(mem_handle, cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        opened = _Opened(ptr=ptr, device=torch.device("cuda", device_index), nbytes=arena_nbytes)
        # Views hold the _Opened as their owner, so the handle is closed only when none is left.
        finalizer = weakref.finalize(opened, _close_mapping, ptr, device_index)
        finalizer.atexit = False  # at exit the driver tears everything down anyway
        _opened[mem_handle] = opened
        cuda_opens += 1
        return opened


def forget_arena(mem_handle: bytes) -> bool:
    """Drop the cached mapping of an arena (a restarted encoder's old one); closed after its last view."""
    with _opened_lock:
        return _opened.pop(mem_handle, None) is not None


def open_mappings() -> int:
    """How many arenas this process holds mapped in its cache."""
    with _opened_lock:
        return len(_opened)


def read_slice(mem_handle: bytes, device_index: int, offset: int, nbytes: int, arena_nbytes: int,
               event_handle: bytes = b"", wait: bool = True) -> torch.Tensor:
    """uint8 view of an entry in another process's arena; the current stream waits on its event."""
    opened = open_arena(mem_handle, device_index, arena_nbytes)
    if opened.nbytes and offset + nbytes > opened.nbytes:
        raise ValueError("slice past the end of the CUDA arena")
    if wait and event_handle:
        event = torch.cuda.Event.from_ipc_handle(opened.device, event_handle)
        event.wait(torch.cuda.current_stream(opened.device))
    return view_device_ptr(opened.ptr + offset, nbytes, opened.device, owner=opened)
