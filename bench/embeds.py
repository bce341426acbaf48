"""Encoder-side timing helpers: one Encode RPC plus the import that makes the tensor usable."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.client import EncoderClient, ImageLike
from common.pb import common_pb2
from common.transport.importer import import_embedding

TRANSPORT_NAMES = {common_pb2.TRANSPORT_CUDA_IPC: "cuda_ipc", common_pb2.TRANSPORT_SHM: "shm",
                   common_pb2.TRANSPORT_INLINE: "inline", common_pb2.TRANSPORT_NIXL: "nixl"}
LOCATION_TRANSPORT = {"cuda_ipc": common_pb2.TRANSPORT_CUDA_IPC, "shm": common_pb2.TRANSPORT_SHM,
                      "inline_data": common_pb2.TRANSPORT_INLINE, "nixl": common_pb2.TRANSPORT_NIXL}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timed:
    """One Encode + import: seconds of the RPC and of the import, the ref's transport and hit flag."""

    rpc_s: float
    import_s: float
    transport: int
    cache_hit: bool
    content_hash: str
    nbytes: int
    shape: tuple[int, ...]

    @property
    def total_s(self) -> float:
        """RPC plus import: from Encode sent to the tensor ready on the reader's device."""
        return self.rpc_s + self.import_s


def encode_and_import(client: EncoderClient, image: ImageLike, accept: list[int],
                      device: torch.device) -> Timed:
    """Encode one image, import its embedding onto device (copying when it lives elsewhere), wait for
    the device, and release the lease (not timed)."""
    t0 = time.perf_counter()
    ref = client.encode([image], accept=accept).embeddings[0]
    t1 = time.perf_counter()
    tensor = import_embedding(ref, device=device)
    if device.type == "cuda":
        tensor = tensor.view(-1)[:1].clone()  # touch it: the view is usable once the stream has waited
    sync(device)
    t2 = time.perf_counter()
    del tensor
    if ref.lease_id:
        client.release([ref.lease_id])
    transport = LOCATION_TRANSPORT[ref.WhichOneof("location")]
    return Timed(t1 - t0, t2 - t1, transport, ref.cache_hit, ref.content_hash, ref.nbytes, tuple(ref.shape))
