"""Multi-part embeddings [parts, rows, hidden] over CUDA IPC: another process imports each entry as one
tensor of that shape, every part's bytes intact (needs CUDA and cupy; the reader is a spawned child)."""

from __future__ import annotations

import multiprocessing as mp

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


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def _reader(refs: list[bytes], queue) -> None:
    """Child: import every ref; send back each tensor's shape and each part's bytes."""
    from common.transport import import_embedding

    torch.cuda.init()
    out = []
    for raw in refs:
        view = import_embedding(common_pb2.EmbeddingRef.FromString(raw))
        assert view.is_cuda
        out.append((tuple(view.shape), [_bytes_of(part) for part in view]))
    queue.put(out)


def test_parts_rows_hidden_entries_cross_processes_by_cuda_ipc():
    cache = EmbeddingCache(CudaArena(64 << 20, "cuda:0"))
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        whole = torch.randn(4, 64 + 300 + 279, 64, device="cuda", generator=g).to(torch.bfloat16)
        tensors = list(whole.split([64, 300, 279], dim=1))  # views, as the Qwen3-VL tower's split gives
        handles = []
        for i, t in enumerate(tensors):
            fut, produce = cache.acquire(f"k{i}")
            assert produce
            cache.complete_many([(f"k{i}", t)], [(1, 8, 8 * (i + 1))])
            handles.append(fut.result(0))
        refs = [build_ref(h, common_pb2.TRANSPORT_CUDA_IPC, cache.arena) for h in handles]
        assert [list(r.shape) for r in refs] == [[4, 64, 64], [4, 300, 64], [4, 279, 64]]
        assert [r.nbytes for r in refs] == [t.numel() * 2 for t in tensors]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_reader, args=([r.SerializeToString() for r in refs], queue))
        proc.start()
        got = queue.get(timeout=120)
        proc.join(60)
        assert proc.exitcode == 0
        for (shape, parts), t in zip(got, tensors, strict=True):
            assert shape == tuple(t.shape)
            assert parts == [_bytes_of(part) for part in t]
        cache.release([h.lease_id for h in handles])
    finally:
        cache.close()
