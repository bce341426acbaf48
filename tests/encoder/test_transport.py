"""Transports: inline bytes, and the SHM arena read by a second process without copying."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from common.pb import common_pb2
from common.transport import can_import, import_embedding, readable_transports
from common.transport.shm import SHM_DIR, ShmArena
from encoder_svc.cache import EmbeddingCache
from encoder_svc.refs import build_ref, inline_payload

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _store(cache: EmbeddingCache, key: str, tensor: torch.Tensor):
    fut, produce = cache.acquire(key)
    assert produce
    cache.complete(key, tensor)
    return fut.result(0)


def _reader(refs: list[bytes], queue) -> None:
    """Child process: import every ref twice, send back raw bytes and how many maps it opened."""
    from common.transport import shm as shm_mod

    out = []
    for raw in refs:
        ref = common_pb2.EmbeddingRef.FromString(raw)
        assert can_import(ref)
        t = import_embedding(ref)
        again = import_embedding(ref)
        assert again.data_ptr() == t.data_ptr(), "a second import must view the same memory"
        out.append((str(t.dtype), list(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()))
    queue.put((out, shm_mod.shm_opens))


@pytest.mark.parametrize("dtype", DTYPES)
def test_inline_roundtrip(dtype):
    cache = EmbeddingCache(ShmArena(1 << 16))
    try:
        x = torch.randn(16, 64).to(dtype)
        h = _store(cache, "k", x)
        ref = build_ref(h, common_pb2.TRANSPORT_INLINE, cache.arena, inline_payload(cache.read(h.entry)))
        assert not ref.lease_id and ref.nbytes == x.numel() * x.element_size()
        y = import_embedding(common_pb2.EmbeddingRef.FromString(ref.SerializeToString()))
        assert y.dtype == dtype and torch.equal(y, x)
        cache.release([h.lease_id])
    finally:
        cache.close()


def test_second_process_reads_shm_and_segment_survives_its_exit():
    arena = ShmArena(1 << 20)
    cache = EmbeddingCache(arena)
    try:
        tensors = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)).to(dt)
                   for i, dt in enumerate(DTYPES)]
        handles = [_store(cache, f"k{i}", t) for i, t in enumerate(tensors)]
        refs = [build_ref(h, common_pb2.TRANSPORT_SHM, arena) for h in handles]
        assert all(r.shm.name == arena.name and r.lease_id for r in refs)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_reader, args=([r.SerializeToString() for r in refs], queue))
        proc.start()
        got, opens = queue.get(timeout=60)
        proc.join(30)
        assert proc.exitcode == 0
        assert opens == 1, "the reader must map the arena once, not once per entry"
        for (dtype, shape, raw), t in zip(got, tensors, strict=True):
            assert dtype == str(t.dtype) and shape == list(t.shape)
            assert raw == t.view(-1).view(torch.uint8).numpy().tobytes()
        # The reader exited: the producer's segment must still be there and usable.
        assert (SHM_DIR / arena.name).exists()
        assert torch.equal(cache.read(handles[0].entry), tensors[0])
        _store(cache, "after", torch.ones(4, 4))
        cache.release([h.lease_id for h in handles])
    finally:
        cache.close()
    assert not (SHM_DIR / arena.name).exists(), "close() unlinks the producer's segment"


def test_transport_choice_helpers():
    kinds = readable_transports("cpu")
    assert kinds[-1] == common_pb2.TRANSPORT_INLINE and common_pb2.TRANSPORT_SHM in kinds
    assert common_pb2.TRANSPORT_CUDA_IPC not in kinds
    elsewhere = common_pb2.EmbeddingRef(shm=common_pb2.ShmLocation(name="mmserve-not-on-this-host"))
    assert not can_import(elsewhere)
    with pytest.raises(FileNotFoundError):
        import_embedding(common_pb2.EmbeddingRef(dtype=common_pb2.DTYPE_FLOAT32, shape=[1], nbytes=4,
                                                 shm=elsewhere.shm))
    gpu = common_pb2.EmbeddingRef(cuda_ipc=common_pb2.CudaIpcLocation(device_uuid="00" * 16))
    assert not can_import(gpu)
    assert can_import(common_pb2.EmbeddingRef(inline_data=b"\0\0\0\0"))


def test_arena_choice_and_transport_negotiation(monkeypatch):
    from common.transport import shm as shm_mod
    from common.transport.arena import TensorArena
    from common.transport.arena_factory import make_arena
    from encoder_svc.refs import choose_transport, served_transports

    shm_arena = make_arena("auto", 1 << 16, torch.device("cpu"))
    # a container's small /dev/shm: writing past it would SIGBUS, so auto falls back to inline only
    monkeypatch.setattr(shm_mod, "shm_free_bytes", lambda: 1 << 16)
    huge = make_arena("auto", 1 << 20, torch.device("cpu"))
    try:
        assert isinstance(shm_arena, ShmArena) and isinstance(huge, TensorArena)
        with pytest.raises(MemoryError, match="shm_size"):
            make_arena("shm", 1 << 20, torch.device("cpu"))
        SHM_, INL, CUDA = common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_INLINE, common_pb2.TRANSPORT_CUDA_IPC
        assert choose_transport([CUDA, SHM_, INL], served_transports(shm_arena)) == SHM_
        assert choose_transport([CUDA, SHM_], served_transports(huge)) == INL  # inline always works
        assert choose_transport([], served_transports(shm_arena)) == INL
        with pytest.raises(ValueError, match="unknown transport"):
            choose_transport([SHM_, 7], served_transports(shm_arena))
    finally:
        shm_arena.close()
        huge.close()
