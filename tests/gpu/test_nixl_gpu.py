"""The NIXL transport on a GPU (needs CUDA, cupy and a nixl package): an encoder's CUDA arena registered
as VRAM (or a CPU encoder's host arena), READ by another process into its own GPU and into host memory;
and the services on one GPU told to use it (`--embedding-transports nixl`), equal to HF with nothing
held after.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from common.pb import common_pb2
from common.transport import nixl as nixl_transport

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("cupy")
if not nixl_transport.nixl_installed():
    pytest.skip("the nixl extra is not installed (pip install -e '.[nixl-cu13]')", allow_module_level=True)

NIXL = common_pb2.TRANSPORT_NIXL
SHAPES = [(1225, 3584), (2, 300, 4096), (7, 128)]  # a Qwen2.5-VL 1024² image, a multi-part one, a small one


def _expected(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(*SHAPES[i], generator=g).to(torch.bfloat16)


def _encoder_process(kind, refs, done) -> None:
    """Stands for an encoder: a CUDA arena (entries written by kernels on a stream) or a host arena (a
    CPU encoder), registered with NIXL; puts the NIXL refs of its entries."""
    from common.transport.arena import TensorArena
    from common.transport.cuda_ipc import CudaArena
    from encoder_svc.cache import EmbeddingCache
    from encoder_svc.refs import build_ref

    torch.cuda.init()
    cache = EmbeddingCache(CudaArena(64 << 20, "cuda:0") if kind == "cuda" else TensorArena(64 << 20))
    exporter = nixl_transport.NixlExporter(cache.arena)
    assert exporter.vram == (kind == "cuda")
    out = []
    for i in range(len(SHAPES)):
        fut, produce = cache.acquire(f"k{i}")
        assert produce
        cache.complete(f"k{i}", _expected(i).cuda() if kind == "cuda" else _expected(i))
        out.append(build_ref(fut.result(0), NIXL, cache.arena, nixl=exporter).SerializeToString())
    refs.put(out)
    done.wait(120)
    exporter.close()
    cache.close()


@pytest.mark.parametrize("kind", ["cuda", "host"])
def test_an_arena_is_read_into_this_gpu_and_into_host_memory(kind):
    """A GPU encoder's rows READ VRAM to VRAM (and to host memory); a CPU encoder's rows to host memory,
    then uploaded."""
    from common.transport import import_embedding

    ctx = mp.get_context("spawn")
    refs, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_encoder_process, args=(kind, refs, done), daemon=True)
    proc.start()
    source = f"enc-{kind}"
    try:
        raw = refs.get(timeout=120)
        parsed = [common_pb2.EmbeddingRef.FromString(r) for r in raw]
        assert all(r.WhichOneof("location") == "nixl" and r.nixl.vram == (kind == "cuda") for r in parsed)
        reader = nixl_transport.reader()
        loads = reader.metadata_loads
        for i, ref in enumerate(parsed):
            on_gpu = import_embedding(ref, device=torch.device("cuda:0"), source=source)
            assert on_gpu.is_cuda and on_gpu.dtype == torch.bfloat16 and tuple(on_gpu.shape) == SHAPES[i]
            assert torch.equal(on_gpu.cpu(), _expected(i))
            on_host = import_embedding(ref, device=torch.device("cpu"), source=source)
            assert not on_host.is_cuda and torch.equal(on_host, _expected(i))
        assert reader.metadata_loads == loads + 1  # the agent once, for six reads
        # The staging buffer is reused: a later READ must not change an earlier result.
        first = import_embedding(parsed[0], device=torch.device("cuda:0"), source=source)
        import_embedding(parsed[1], device=torch.device("cuda:0"), source=source)
        assert torch.equal(first.cpu(), _expected(0))
    finally:
        done.set()
        proc.join(60)


def test_pair_on_one_gpu_reads_over_nixl_when_told_and_matches_hf(tiny_model_dir, tmp_path):
    from common.families.llava.oracle import LlavaOracle
    from tests.integration.conftest import png
    from tests.integration.harness import Pair
    from tests.oracle import make_image

    prompt = "USER: <image>\nWhat is in this picture? ASSISTANT:"
    oracle = LlavaOracle(tiny_model_dir, device="cuda", dtype=torch.float32)
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=["--device", "cuda", "--nixl"],
                decoder_args=["--device", "cuda", "--embedding-transports", "nixl",
                              "--max-num-batched-tokens", "64"]).start()
    try:
        images = [make_image(s) for s in (31, 32, 33)]
        with pair.decoder_client() as client:
            for image in images:
                result = client.generate_text(prompt, [png(image)], max_tokens=12)
                oracle.assert_same_tokens(result.token_ids, prompt, [image], 12)
            transports = dict(client.stats().embedding_transports)
        print(f"\ndecoder embedding transports: {transports}")
        assert transports == {"nixl": 3}
        d, e = pair.wait_idle()
        assert d.kv_blocks_used == 0 and d.active_leases == 0 and e.active_leases == 0
    finally:
        pair.stop()
