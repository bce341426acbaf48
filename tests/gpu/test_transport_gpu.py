"""CUDA IPC transport between independent processes on one GPU (needs CUDA and cupy).

A process cannot open its own IPC handle, so every reader here is a spawned child process.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from common.pb import common_pb2

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from common.transport.cuda_ipc import CudaArena  # noqa: E402
from encoder_svc.cache import EmbeddingCache  # noqa: E402
from encoder_svc.refs import build_ref  # noqa: E402

CUDA = common_pb2.TRANSPORT_CUDA_IPC


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def _reader(refs: list[bytes], queue) -> None:
    """Child: import every ref, time each handoff, send back bytes, timings and the open count."""
    from common.transport import cuda_ipc, import_embedding

    torch.cuda.init()
    out, times = [], []
    for raw in refs:
        ref = common_pb2.EmbeddingRef.FromString(raw)
        t0 = time.perf_counter()
        view = import_embedding(ref)
        times.append(time.perf_counter() - t0)
        assert view.is_cuda
        out.append(_bytes_of(view))
    queue.put((out, times, cuda_ipc.cuda_opens))


def _stale_reader(warm_ref: bytes, inbox, outbox) -> None:
    """Child: open the arena early, then read a ref without and with waiting on its event."""
    from common.transport import import_embedding

    torch.cuda.init()
    import_embedding(common_pb2.EmbeddingRef.FromString(warm_ref))  # the slow first open, done now
    torch.cuda.synchronize()
    outbox.put("ready")
    ref = common_pb2.EmbeddingRef.FromString(inbox.get(timeout=60))
    early = import_embedding(ref, wait=False).clone()
    torch.cuda.synchronize()
    waited = import_embedding(ref, wait=True).clone()
    torch.cuda.synchronize()
    outbox.put((_bytes_of(early), _bytes_of(waited)))


def _store(cache: EmbeddingCache, key: str, tensor: torch.Tensor):
    fut, produce = cache.acquire(key)
    assert produce
    cache.complete(key, tensor)
    return fut.result(0)


def test_second_process_reads_cuda_ipc_refs_opening_the_arena_once():
    cache = EmbeddingCache(CudaArena(256 << 20, "cuda:0"))
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        tensors = [torch.randn(576, 4096, device="cuda", generator=g).to(
            torch.bfloat16 if i % 2 else torch.float32) for i in range(16)]
        handles = [_store(cache, f"k{i}", t) for i, t in enumerate(tensors)]
        refs = [build_ref(h, CUDA, cache.arena) for h in handles]
        assert all(r.cuda_ipc.device_uuid for r in refs)  # event handles only for writes in flight
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_reader, args=([r.SerializeToString() for r in refs], queue))
        proc.start()
        got, times, opens = queue.get(timeout=120)
        proc.join(60)
        assert proc.exitcode == 0
        assert opens == 1, f"arena opened {opens} times for {len(refs)} entries"
        for raw, t in zip(got, tensors, strict=True):
            assert raw == _bytes_of(t)
        later = sorted(times[1:])
        print(f"\nCUDA IPC first import (opens the arena): {1e3 * times[0]:.1f} ms; "
              f"later imports: median {1e6 * later[len(later) // 2]:.0f} us, max {1e6 * later[-1]:.0f} us "
              f"per entry ({tensors[0].numel()} elements)")
        cache.release([h.lease_id for h in handles])
    finally:
        cache.close()


def test_reader_waits_on_the_producer_event_or_reads_stale_bytes():
    arena = CudaArena(16 << 20, "cuda:0")
    cache = EmbeddingCache(arena)
    try:
        arena.view(0, arena.capacity).zero_()
        warm = _store(cache, "warm", torch.ones(8, 8, device="cuda"))
        values = torch.arange(1, 1 + 256 * 1024, device="cuda", dtype=torch.float32).view(256, 1024)
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=_stale_reader,
                           args=(build_ref(warm, CUDA, arena).SerializeToString(), inbox, outbox))
        proc.start()
        assert outbox.get(timeout=120) == "ready"
        side = torch.cuda.Stream()
        fut, _ = cache.acquire("late")
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(3e9))  # ~1.5-2 s of GPU time before the write lands
            cache.complete("late", values)  # write + event, both queued behind the sleep
        handle = fut.result(0)
        pending = build_ref(handle, CUDA, arena)
        assert pending.cuda_ipc.event_handle, "a write still in flight must come with its event"
        inbox.put(pending.SerializeToString())  # no host synchronisation
        early, waited = outbox.get(timeout=120)
        proc.join(60)
        assert waited == _bytes_of(values), "waiting on the producer event must give the written values"
        assert early != waited, "without the wait the reader should have seen the stale (zero) bytes"
        assert early == bytes(len(early))
        torch.cuda.synchronize()
        assert build_ref(handle, CUDA, arena).cuda_ipc.event_handle == b"", \
            "a finished write needs no event: the reader has nothing to wait for"
        cache.release([warm.lease_id, handle.lease_id])
    finally:
        torch.cuda.synchronize()
        cache.close()


def _server_reader(refs: list[bytes], queue) -> None:
    from common.transport import can_import, import_embedding

    torch.cuda.init()
    out = []
    for raw in refs:
        ref = common_pb2.EmbeddingRef.FromString(raw)
        assert can_import(ref)
        out.append(_bytes_of(import_embedding(ref)))
    queue.put(out)


def test_gpu_encoder_server_hands_out_cuda_ipc_refs(tiny_model_dir):
    pytest.importorskip("grpc_health")
    from common.images import decode_image
    from encoder_svc.server import EncoderConfig
    from tests.encoder.conftest import EncoderHarness, encode_request, image_bytes

    harness = EncoderHarness(EncoderConfig(model=tiny_model_dir, device="cuda", cache_bytes=1 << 20))
    try:
        datas = [image_bytes(i) for i in range(3)]
        resp = harness.stub.Encode(encode_request(*datas, accept=[CUDA, common_pb2.TRANSPORT_INLINE]),
                                   timeout=60)
        assert all(r.WhichOneof("location") == "cuda_ipc" for r in resp.embeddings)
        expected = harness.servicer.vision.encode([decode_image(d) for d in datas])
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_server_reader,
                           args=([r.SerializeToString() for r in resp.embeddings], queue))
        proc.start()
        got = queue.get(timeout=120)
        proc.join(60)
        for raw, e in zip(got, expected, strict=True):
            t = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(e.shape)
            torch.testing.assert_close(t, e.cpu(), rtol=1e-4, atol=1e-4)
        harness.release_all(resp)
        assert harness.stats().active_leases == 0
    finally:
        harness.close()


def _restart_reader(inbox, outbox) -> None:
    """Child: read one ref per arena of the same source; report bytes, open mappings and closes."""
    import gc

    from common.transport import cuda_ipc, importer

    torch.cuda.init()
    for _ in range(2):
        ref = common_pb2.EmbeddingRef.FromString(inbox.get(timeout=120))
        raw = _bytes_of(importer.import_embedding(ref, source="encoder-0:50051"))
        gc.collect()  # no view of the previous arena is left: its IPC mapping closes now
        outbox.put((raw, importer.open_mappings(), cuda_ipc.cuda_opens, cuda_ipc.cuda_closes))


def test_restarted_encoders_new_arena_is_mapped_and_the_old_one_closed():
    first = EmbeddingCache(CudaArena(16 << 20, "cuda:0"))
    second = None
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_restart_reader, args=(inbox, outbox))
    proc.start()
    try:
        a = _store(first, "k", torch.full((64,), 1.0, device="cuda"))
        inbox.put(build_ref(a, CUDA, first.arena).SerializeToString())
        raw, mappings, opens, closes = outbox.get(timeout=120)
        assert raw == _bytes_of(torch.full((64,), 1.0)) and (mappings, opens, closes) == (1, 1, 0)

        second = EmbeddingCache(CudaArena(16 << 20, "cuda:0"))  # the encoder "restarted": a new handle
        assert second.arena.mem_handle != first.arena.mem_handle
        b = _store(second, "k", torch.full((64,), 2.0, device="cuda"))
        inbox.put(build_ref(b, CUDA, second.arena).SerializeToString())
        raw, mappings, opens, closes = outbox.get(timeout=120)
        assert raw == _bytes_of(torch.full((64,), 2.0)), "read the old arena's bytes"
        assert (mappings, opens, closes) == (1, 2, 1), "the superseded arena must be unmapped"
        proc.join(60)
        assert proc.exitcode == 0
        first.release([a.lease_id])
        second.release([b.lease_id])
    finally:
        if proc.is_alive():
            proc.kill()
        first.close()  # only after the reader closed its mapping of it
        if second is not None:
            second.close()
