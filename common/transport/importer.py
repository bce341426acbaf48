"""The reader's side: turn an EmbeddingRef into a torch tensor, whichever transport carried it.

Arenas are mapped once per process and cached by identity: an SHM segment by name and inode, a CUDA
arena by its IPC handle, so a restarted encoder's new arena is always mapped afresh. A caller that
says which encoder a ref came from (`source`) also lets go of that encoder's previous arena as soon
as a ref from its new one is read, so a dead encoder's memory is not pinned by this process.
"""

from __future__ import annotations

import math
import threading

import torch

from common.pb import common_pb2
from common.transport import cuda_ipc as cuda
from common.transport import dtypes, inline, nixl, shm


def readable_transports(device: torch.device | str | None = None) -> list[int]:
    """Transports this process can read, best first: put this in EncodeRequest.accept.

    CUDA IPC needs a CUDA reader device and cupy; SHM needs /dev/shm; NIXL the nixl package (it copies,
    so it comes after the zero-copy ones); inline always works. Whether a given ref is readable (same
    GPU, same host) is `can_import`: a caller that gets an unreadable ref asks again by content hash
    with the transports that work across hosts (NIXL, if it accepts it, and inline).
    """
    out = []
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and cuda.cuda_ipc_available():
        out.append(common_pb2.TRANSPORT_CUDA_IPC)
    if shm.shm_available():
        out.append(common_pb2.TRANSPORT_SHM)
    if nixl.nixl_installed():
        out.append(common_pb2.TRANSPORT_NIXL)
    out.append(common_pb2.TRANSPORT_INLINE)
    return out


TRANSPORT_BY_NAME = {"cuda_ipc": common_pb2.TRANSPORT_CUDA_IPC, "shm": common_pb2.TRANSPORT_SHM,
                     "nixl": common_pb2.TRANSPORT_NIXL, "inline": common_pb2.TRANSPORT_INLINE}


def accepted_transports(names: list[str] | None, device: torch.device | str | None = None) -> list[int]:
    """The transports to ask encoders for, best first: `names` in the order given (None: every one this
    process can read, `readable_transports`), inline always last (the fallback when a ref cannot be read).

    Raises ValueError naming a transport that is unknown or that this process cannot read (no GPU or
    cupy for cuda_ipc, no /dev/shm, no nixl package)."""
    readable = readable_transports(device)
    if names is None:
        return readable
    out = []
    for name in names:
        transport = TRANSPORT_BY_NAME.get(name)
        if transport is None:
            raise ValueError(f"unknown embedding transport {name!r} (known: {', '.join(TRANSPORT_BY_NAME)})")
        if transport not in readable:
            why = {"cuda_ipc": "it needs a CUDA device and cupy", "shm": "this host has no /dev/shm",
                   "nixl": "the nixl extra is not installed (pip install -e '.[nixl]')"}[name]
            raise ValueError(f"embedding transport {name!r} cannot be read here: {why}")
        if transport not in out:
            out.append(transport)
    if common_pb2.TRANSPORT_INLINE not in out:
        out.append(common_pb2.TRANSPORT_INLINE)
    return out


def transport_list_names(transports: list[int]) -> str:
    """Transports for people, in order: "nixl,inline"."""
    return ",".join(common_pb2.Transport.Name(t).removeprefix("TRANSPORT_").lower() for t in transports)


def can_import(ref: common_pb2.EmbeddingRef) -> bool:
    """True when this process can read ref: its GPU is visible here, or its segment is on this host."""
    kind = ref.WhichOneof("location")
    if kind == "inline_data":
        return True
    if kind == "shm":
        return shm.segment_exists(ref.shm.name)
    if kind == "cuda_ipc":
        return cuda.cuda_ipc_available() and cuda.local_device_index(ref.cuda_ipc.device_uuid) is not None
    if kind == "nixl":  # whether the READ works shows only when it is tried (NixlTransferError)
        return nixl.nixl_installed()
    return False


_ArenaKey = tuple[str, str | bytes]  # ("shm", segment name) or ("cuda_ipc", mem handle)

_arena_of_source: dict[str, _ArenaKey] = {}
_sources_lock = threading.Lock()


def open_mappings() -> int:
    """How many arenas (SHM segments and CUDA IPC arenas) this process holds mapped."""
    return shm.open_mappings() + cuda.open_mappings()


def _note_arena(source: str, key: _ArenaKey) -> None:
    """Record source's current arena; forget the one it replaces (unless another source still uses it)."""
    with _sources_lock:
        old = _arena_of_source.get(source)
        _arena_of_source[source] = key
        if old is None or old == key or old in _arena_of_source.values():
            return
    kind, ident = old
    if kind == "shm":
        shm.forget_segment(ident)
    else:
        cuda.forget_arena(ident)


def check_shape(ref: common_pb2.EmbeddingRef, dtype: torch.dtype) -> tuple[int, ...]:
    """ref's shape, checked: every size positive and exactly nbytes of dtype in all. Encoders send
    [rows, hidden], or [parts, rows, hidden] for a multi-part embedding (Qwen3-VL's merged features and
    DeepStack levels). ValueError otherwise: a malformed ref must not become a view of other bytes."""
    shape = tuple(int(x) for x in ref.shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"embedding shape {list(shape)} is empty or has a size below 1")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != ref.nbytes:
        raise ValueError(f"embedding shape {list(shape)} of {dtype} is {math.prod(shape) * itemsize} bytes, "
                         f"the ref says {ref.nbytes}")
    return shape


def import_embedding(ref: common_pb2.EmbeddingRef, device: torch.device | str | None = None,
                     wait: bool = True, source: str | None = None) -> torch.Tensor:
    """The embedding as a tensor view of the encoder's arena where possible, of the ref's shape:
    [num_image_tokens, hidden], or [parts, num_image_tokens, hidden] for a multi-part embedding (part 0
    the merged features, then the DeepStack levels), one contiguous row-major slice either way.

    CUDA IPC: a view on the encoder's GPU (no copy); the current stream waits on the producer event
    unless wait=False (tests use that to show stale reads). SHM: a CPU view of the mapped segment.
    Inline: a CPU tensor. NIXL: a tensor of our own, READ from the encoder's arena (on `device` when it
    is a GPU, else on the host); NixlTransferError when the READ fails. If `device` differs from where
    the view lives, the result is copied there.
    The view is valid while the lease is held: copy it (or finish using it) before Release.

    source names the encoder (its address) that sent ref: when a ref from a new arena of the same
    source is read, the mapping of its previous arena (a restarted encoder's) is dropped. Views of the
    old arena still in use stay valid; it is unmapped when the last is collected.
    """
    dtype = dtypes.to_torch(ref.dtype)
    shape = check_shape(ref, dtype)  # before anything is mapped
    kind = ref.WhichOneof("location")
    key: _ArenaKey | None = None
    if kind == "inline_data":
        raw = inline.read_bytes(ref.inline_data)
    elif kind == "shm":
        raw = shm.read_slice(ref.shm.name, ref.shm.offset, ref.nbytes, ref.shm.arena_nbytes)
        key = ("shm", ref.shm.name)
    elif kind == "cuda_ipc":
        loc = ref.cuda_ipc
        index = cuda.local_device_index(loc.device_uuid)
        if index is None:
            raise ValueError(f"GPU {loc.device_uuid} of this CUDA IPC ref is not visible in this process")
        raw = cuda.read_slice(loc.mem_handle, index, loc.offset, ref.nbytes, loc.arena_nbytes,
                              loc.event_handle, wait=wait)
        key = ("cuda_ipc", loc.mem_handle)
    elif kind == "nixl":  # the reader keeps its own agents per source
        raw = nixl.read_slice(ref.nixl, ref.nbytes, source=source, device=device)
    else:
        raise ValueError("EmbeddingRef has no location")
    if source is not None and key is not None:  # after a good read: a failed one must not drop the old
        _note_arena(source, key)
    if raw.numel() != ref.nbytes:
        raise ValueError(f"embedding has {raw.numel()} bytes, the ref says {ref.nbytes}")
    out = dtypes.typed_view(raw, dtype, shape)
    if device is not None and torch.device(device) != out.device:
        out = out.to(device)
    return out
