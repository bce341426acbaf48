"""The decode pool's worker process: it answers decode jobs (and pickled calls) over one socket, the
image bytes and pixels passing through the pool's shared-memory slots (decode_pool.py drives it).

The socket protocol is defined here, for both ends.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import threading
import time

from common.freed_memory import LARGE_JOB_BYTES, release_freed_memory, reuse_freed_blocks
from common.images import ImageError, ImageLimits
from common.startup import dump_stacks_on_signal
from encoder_svc.decoded_image import DecodedImage, decode_and_hash

_mapped: dict[str, mmap.mmap] = {}  # a child's mappings of its pool's slot segment, by path


def _slot_view(path: str) -> mmap.mmap:
    # Plain mmap, not multiprocessing.shared_memory: on Python < 3.13 attaching registers the segment
    # with the resource tracker, which would unlink it when this child exits (common/transport/shm.py).
    if path not in _mapped:
        with open(path, "r+b") as f:
            _mapped[path] = mmap.mmap(f.fileno(), 0)
    return _mapped[path]


def decode_in_slot(slot_path: str, offset: int, length: int, capacity: int, limits: ImageLimits,
                   fingerprint: str, salt: str) -> DecodedImage:
    """`decode_and_hash` of the file bytes at [offset, offset + length) of the slot segment, in a worker
    process. Pixels that fit the slot are written over it and come back empty (the parent copies them
    out); larger ones come back in the reply."""
    view = _slot_view(slot_path)
    decoded = decode_and_hash(view[offset:offset + length], limits, fingerprint, salt)
    if len(decoded.pixels) > capacity:
        return decoded.owned()
    view[offset:offset + len(decoded.pixels)] = decoded.pixels
    return DecodedImage(decoded.content_hash, decoded.width, decoded.height, b"")


def _exit_with_parent(parent: int) -> None:
    """Exit once the server is gone, even in the middle of a job (a SIGKILLed server cannot stop us)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# The socket protocol. Frames are multiprocessing's (a 4-byte big-endian length, then the payload), so
# the child keeps its Connection; the server reads and writes the socket itself, from the event loop,
# and parses every frame a read brings. A payload starts with a tag:
# - DECODE: a decode job (job id, slot offset, file length, slot capacity, then fingerprint, salt and
#   the slot segment's path), or its reply when the pixels are in the slot (job id, width, height, hex
#   hash). Packed, not pickled: pickling these cost the server's loop more than the socket did.
# - PICKLED: anything else, pickled: `run` jobs (job id, fn, args), their replies and failures (job id,
#   ok, value), decodes whose pixels did not fit the slot, and the child's ("ready", pid).
FRAME = struct.Struct("!i")
MAX_FRAME_BYTES = (1 << 31) - (1 << 20)  # a reply's payload, with room for its fields
READ_BYTES = 1 << 18  # one read of a child's replies (a decode's is 85 bytes; pixels past a slot, MBs)
DECODE, PICKLED = b"D", b"P"
DECODE_JOB = struct.Struct("<QQQQHHH")  # job id, offset, length, capacity, len(fingerprint, salt, path)
DECODED = struct.Struct("<QII64s")  # job id, width, height, hex content hash


def decode_job(job_id: int, offset: int, length: int, capacity: int, fingerprint: str, salt: str,
                path: str) -> bytes:
    texts = [t.encode() for t in (fingerprint, salt, path)]
    return DECODE + DECODE_JOB.pack(job_id, offset, length, capacity, *map(len, texts)) + b"".join(texts)


def _run_decode_job(payload: bytes, limits: ImageLimits) -> bytes:
    """A decode job's reply payload (in the child)."""
    job_id, offset, length, capacity, *sizes = DECODE_JOB.unpack_from(payload, 1)
    texts, at = [], 1 + DECODE_JOB.size
    for size in sizes:
        texts.append(payload[at:at + size].decode())
        at += size
    fingerprint, salt, path = texts
    try:
        decoded = decode_in_slot(path, offset, length, capacity, limits, fingerprint, salt)
    except Exception as exc:  # noqa: BLE001 - the server raises it for its caller
        return PICKLED + pickle.dumps((job_id, False, exc))
    nbytes = 3 * decoded.width * decoded.height
    try:
        return _decoded_reply(job_id, decoded)
    finally:
        del decoded
        if nbytes >= LARGE_JOB_BYTES:  # a large image's freed blocks go back to the system
            release_freed_memory()


def _decoded_reply(job_id: int, decoded: DecodedImage) -> bytes:
    if decoded.pixels:  # larger than the slot: they travel in the reply
        if len(decoded.pixels) > MAX_FRAME_BYTES:  # the server's frames have a 31-bit length
            return PICKLED + pickle.dumps((job_id, False, ImageError(
                f"{decoded.width}x{decoded.height} pixels are too many to hand over")))
        return PICKLED + pickle.dumps((job_id, True, decoded))
    return DECODE + DECODED.pack(job_id, decoded.width, decoded.height, decoded.content_hash.encode())


def _run_pickled_job(payload: bytes) -> bytes:
    job_id, fn, args = pickle.loads(payload[1:])
    try:
        reply = (job_id, True, fn(*args))
    except Exception as exc:  # noqa: BLE001 - the server raises it for its caller
        reply = (job_id, False, exc)
    return PICKLED + pickle.dumps(reply)


def child_main(conn, parent: int, limits: ImageLimits) -> None:
    """A decode process: answer job frames with reply frames until the server closes the socket."""
    _exit_with_parent(parent)
    reuse_freed_blocks()  # each decode's pixels, megabytes (large images still trim after)
    dump_stacks_on_signal()
    conn.send_bytes(PICKLED + pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if payload[:1] == DECODE:
            conn.send_bytes(_run_decode_job(payload, limits))
        else:
            conn.send_bytes(_run_pickled_job(payload))
