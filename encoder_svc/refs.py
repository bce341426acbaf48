"""Transport choice and EmbeddingRef building on the encoder side."""

from __future__ import annotations

from common.pb import common_pb2
from common.transport import dtypes, inline
from common.transport.arena import Arena
from common.transport.nixl import NixlExporter
from common.transport.shm import ShmArena
from encoder_svc.cache import Handle

KNOWN_TRANSPORTS = (common_pb2.TRANSPORT_CUDA_IPC, common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE,
                    common_pb2.TRANSPORT_NIXL)


def served_transports(arena: Arena, nixl: NixlExporter | None = None) -> set[int]:
    """What this arena can hand out: its zero-copy transport (if exported), NIXL when the arena is
    registered with an agent, and always inline."""
    out = {common_pb2.TRANSPORT_INLINE}
    if nixl is not None:
        out.add(common_pb2.TRANSPORT_NIXL)
    if isinstance(arena, ShmArena):
        out.add(common_pb2.TRANSPORT_SHM)
    elif getattr(arena, "mem_handle", None):  # CudaArena; not imported here: it needs no cupy
        out.add(common_pb2.TRANSPORT_CUDA_IPC)
    return out


def transport_names(served: set[int]) -> str:
    """The served transports for people: "inline,nixl,shm" (the ready line and stats)."""
    return ",".join(sorted(common_pb2.Transport.Name(t).removeprefix("TRANSPORT_").lower() for t in served))


def choose_transport(accept, served: set[int]) -> int:
    """The first transport in accept that is served; inline when none is (or accept is empty).

    Raises ValueError for UNSPECIFIED or values this server does not know.
    """
    for value in accept:
        if value not in KNOWN_TRANSPORTS:
            raise ValueError(f"unknown transport {value} in accept")
    for value in accept:
        if value in served:
            return value
    return common_pb2.TRANSPORT_INLINE


def build_ref(handle: Handle, transport: int, arena: Arena, inline_bytes: bytes | None = None,
              nixl: NixlExporter | None = None, nixl_agent_known: str = "",
              asked_at: float | None = None) -> common_pb2.EmbeddingRef:
    """The EmbeddingRef for one handle; inline refs carry the bytes and no lease. A NIXL ref carries
    the agent's metadata unless the caller named that agent as loaded (nixl_agent_known).

    `asked_at` (the cache's clock when the Encode arrived): the lease's time is counted from then, so
    that it covers the Encode's own time. A caller bounds a lease by the moment it sent the Encode (the
    only moment it knows); an Encode that ran longer than the TTL would otherwise look lapsed on arrival.
    """
    entry = handle.entry
    ref = common_pb2.EmbeddingRef(
        content_hash=entry.key, shape=list(entry.shape), dtype=dtypes.to_wire(entry.dtype),
        nbytes=entry.nbytes, cache_hit=handle.hit, grid_thw=list(entry.grid))
    if entry.timing is not None:  # a video: what its prompt layout needs besides the grid
        ref.video_timestamps.extend(entry.timing.timestamps)
        ref.second_per_grid = entry.timing.second_per_grid
    if transport == common_pb2.TRANSPORT_INLINE:
        ref.inline_data = inline_bytes if inline_bytes is not None else b""
        return ref
    ref.lease_id = handle.lease_id
    ref.lease_expires_in_s = handle.lease_expires_in_s
    if asked_at is not None and handle.expires_at:
        ref.lease_expires_in_s = max(handle.lease_expires_in_s, handle.expires_at - asked_at)
    if transport == common_pb2.TRANSPORT_SHM:
        ref.shm.name = arena.name
        ref.shm.offset = entry.offset
        ref.shm.arena_nbytes = arena.capacity
    elif transport == common_pb2.TRANSPORT_NIXL:
        if nixl is None:
            raise ValueError("TRANSPORT_NIXL without a NIXL agent")
        # A reader has no event to wait on: a GPU entry's write must be finished before its rows are
        # handed out (untested on CPU-only CI, where the arena is host memory and there is no event).
        if entry.event is not None and not entry.event.query():
            entry.event.synchronize()
        nixl.fill(ref.nixl, entry.offset, send_metadata=nixl_agent_known != nixl.name)
    else:
        loc = ref.cuda_ipc
        loc.mem_handle = arena.mem_handle
        loc.offset = entry.offset
        loc.device_uuid = arena.device_uuid
        # A finished write is visible to any later reader: no event to open and wait on (opening an
        # interprocess event costs the reader more than the rest of a hit's import).
        if entry.event is not None and not entry.event.query():
            loc.event_handle = entry.event_handle
        loc.arena_nbytes = arena.capacity
    return ref


def inline_payload(tensor) -> bytes:
    """The bytes of an embedding view for the inline transport."""
    return inline.to_bytes(tensor)


def grid_message(entry) -> common_pb2.ImageGrid:
    """Lookup's answer for one hash: the entry's grid and, for a video, its timing (empty when absent)."""
    if entry is None:
        return common_pb2.ImageGrid()
    grid = common_pb2.ImageGrid(thw=list(entry.grid))
    if entry.timing is not None:
        grid.video_timestamps.extend(entry.timing.timestamps)
        grid.second_per_grid = entry.timing.second_per_grid
    return grid
