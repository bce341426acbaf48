"""The NIXL transport between two processes (UCX on this host): an encoder-side process registers its
arena once and builds refs with encoder_svc.refs; this process READs them through the importer. The
agent's metadata comes once; a READ that cannot be done fails with NixlTransferError, never hangs."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from common.pb import common_pb2
from common.transport import import_embedding, readable_transports
from common.transport import nixl as nixl_transport
from common.transport.importer import can_import

if not nixl_transport.nixl_installed():
    pytest.skip("the nixl extra is not installed (pip install -e '.[nixl]')", allow_module_level=True)

PARTS, ROWS, HIDDEN = 4, 16, 32  # a multi-part (DeepStack) embedding: one slice
SHAPE = (PARTS, ROWS, HIDDEN)


def _embedding(seed: int) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed))


def _encoder_process(refs, done) -> None:
    """Stands for an encoder: a cache over a private arena (no SHM export), NIXL refs for two entries."""
    from common.transport.arena import TensorArena
    from encoder_svc.cache import EmbeddingCache
    from encoder_svc.refs import build_ref, served_transports

    nbytes = PARTS * ROWS * HIDDEN * 4
    cache = EmbeddingCache(TensorArena(4 * nbytes))
    exporter = nixl_transport.NixlExporter(cache.arena)
    assert common_pb2.TRANSPORT_NIXL in served_transports(cache.arena, exporter)
    out = []
    for key, seed in (("a", 1), ("b", 2)):
        fut, produce = cache.acquire(key, True, expected_nbytes=nbytes)
        assert produce
        cache.complete_many([(key, _embedding(seed))], [(1, 8, 8)])
        handle = fut.result(0)
        # The second ref is built for a caller that has loaded the agent already: no metadata.
        known = exporter.name if key == "b" else ""
        out.append(build_ref(handle, common_pb2.TRANSPORT_NIXL, cache.arena, nixl=exporter,
                             nixl_agent_known=known).SerializeToString())
    refs.put(out)
    done.wait(60)
    exporter.close()
    cache.close()


@pytest.fixture(scope="module")
def encoder_refs():
    ctx = mp.get_context("spawn")
    refs, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder_process, args=(refs, done), daemon=True)
    proc.start()
    try:
        raw = refs.get(timeout=120)
        yield [common_pb2.EmbeddingRef.FromString(r) for r in raw]
    finally:
        done.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_refs_carry_the_agent_once_and_read_equal_across_processes(encoder_refs):
    a, b = encoder_refs
    assert a.WhichOneof("location") == "nixl" and a.lease_id and list(a.shape) == list(SHAPE)
    assert a.nixl.agent_metadata and not b.nixl.agent_metadata  # b's caller named the agent
    assert a.nixl.agent_name == b.nixl.agent_name and not a.nixl.vram
    assert b.nixl.address - a.nixl.address == b.nixl.offset - a.nixl.offset
    assert common_pb2.TRANSPORT_NIXL in readable_transports("cpu") and can_import(a)
    out_a = import_embedding(a, source="enc-1")
    reader = nixl_transport.reader()
    loads = reader.metadata_loads
    assert nixl_transport.known_agent("enc-1") == a.nixl.agent_name
    out_b = import_embedding(b, source="enc-1")  # no metadata in the ref: the loaded agent serves it
    assert out_a.shape == SHAPE and torch.equal(out_a, _embedding(1))
    assert torch.equal(out_b, _embedding(2)) and torch.equal(out_b[3], _embedding(2)[3])
    assert reader.metadata_loads == loads  # once per encoder, not per ref
    again = import_embedding(a, source="enc-1")
    assert torch.equal(again, out_a) and again.data_ptr() != out_a.data_ptr()  # copies of our own


def test_a_read_outside_the_registered_arena_fails_cleanly_and_forgets_the_agent(encoder_refs):
    a, b = encoder_refs
    bad = common_pb2.EmbeddingRef()
    bad.CopyFrom(a)
    bad.nixl.address = a.nixl.address - (1 << 20)  # not registered by the encoder
    bad.nixl.offset = 0
    with pytest.raises(nixl_transport.NixlTransferError):
        import_embedding(bad, source="enc-2")
    assert nixl_transport.known_agent("enc-2") == ""  # dropped: the next Encode asks for metadata again
    with pytest.raises(nixl_transport.NixlTransferError, match="not known"):
        import_embedding(b, source="enc-2")  # a ref without metadata for an agent not loaded
    assert torch.equal(import_embedding(a, source="enc-2"), _embedding(1))  # metadata again: reads again


def test_a_slice_past_the_arena_is_refused_before_any_read(encoder_refs):
    a, _ = encoder_refs
    bad = common_pb2.EmbeddingRef()
    bad.CopyFrom(a)
    bad.nixl.offset = a.nixl.arena_nbytes - 16
    with pytest.raises(ValueError, match="past the end"):
        import_embedding(bad)


@pytest.mark.parametrize("read_before", [False, True], ids=["never-connected", "connected"])
def test_a_dead_encoders_read_fails_cleanly(read_before):
    """The encoder process is SIGKILLed (before any READ, or after one connected us): the next READ
    raises NixlTransferError at once (the remote source then asks for the bytes), never hangs."""
    ctx = mp.get_context("spawn")
    refs, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder_process, args=(refs, done), daemon=True)
    proc.start()
    try:
        a, _ = [common_pb2.EmbeddingRef.FromString(r) for r in refs.get(timeout=120)]
        source = f"dead-{read_before}"
        if read_before:
            assert torch.equal(import_embedding(a, source=source), _embedding(1))
    finally:
        proc.kill()
        proc.join(30)
    with pytest.raises(nixl_transport.NixlTransferError):
        import_embedding(a, source=source)
    assert nixl_transport.known_agent(source) == ""  # forgotten: a restarted encoder sends new metadata


def test_cuda_ipc_reads_are_turned_on_unless_the_environment_says_otherwise(monkeypatch):
    """UCX turns CUDA IPC READs off without NVLink (then emulates them over TCP, ~100x slower on a
    one-GPU host): the agents turn them on before UCX starts, unless the operator set the variable."""
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    nixl_transport._new_agent("mmserve-test-env-0")
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ  # no CUDA: UCX would warn of it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    nixl_transport._new_agent("mmserve-test-env-1")
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    nixl_transport._new_agent("mmserve-test-env-2")
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"
