"""The arena an encoder's cache lives in, chosen for its device and host."""

from __future__ import annotations

import logging

import torch

from common.transport.arena import Arena, TensorArena

log = logging.getLogger("mmserve.transport")

def make_arena(kind: str, capacity: int, device: torch.device) -> Arena:
    """The arena of `kind` (auto, shm, cuda or private): auto picks CUDA IPC on GPUs with cupy,
    /dev/shm on CPUs with room for it, else a private one."""
    from common.transport.shm import ShmArena, shm_available, shm_free_bytes, sweep_stale_segments

    if kind in ("auto", "shm") and shm_available():
        sweep_stale_segments()  # a SIGKILLed encoder's segment still fills /dev/shm; its lock is free
    if kind == "auto":
        if device.type == "cuda":
            from common.transport.cuda_ipc import cuda_ipc_available

            kind = "cuda" if cuda_ipc_available() else "private"
        elif shm_available() and shm_free_bytes() >= capacity:
            kind = "shm"
        else:
            log.warning("no room for a %d-byte arena in /dev/shm: embeddings go inline only "
                        "(give the container shm_size or ipc: host for zero-copy)", capacity)
            kind = "private"
    if kind == "cuda":
        from common.transport.cuda_ipc import CudaArena

        return CudaArena(capacity, device)
    if kind == "shm":
        return ShmArena(capacity)
    return TensorArena(capacity, device)
