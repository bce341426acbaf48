"""The FP8 kernels on the GPU against the torch reference (dequantize, then an ordinary product), and an
FP8 engine with CUDA graphs serving the tiny model."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.model.quant.fp8 import ScaleBlock, dequantize, per_channel_block, quantize_per_channel
from tests.gpu.graph_replay import assert_replays_as_eager

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _reference(x, q, scale, block, bias):
    out = torch.nn.functional.linear(x.float(), dequantize(q, scale, block), None if bias is None
                                     else bias.float())
    return out


def _check(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (out.float() - ref).norm() / ref.norm()
    assert err < rel, f"relative error {err:.2e} >= {rel}"


@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 352), (12288, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_per_channel(m, n, k, bias):
    from common.kernels.fp8_linear import weight_only_fp8

    torch.manual_seed(m + n)
    q, scale = quantize_per_channel(torch.randn(n, k, device=DEV) / k**0.5)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    out = weight_only_fp8(x, q, scale, per_channel_block(k), b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _check(out, _reference(x, q, scale, per_channel_block(k), b), 5e-3)  # bf16 output rounding


@pytest.mark.parametrize("block", [ScaleBlock(128, 128), ScaleBlock(1, 128), ScaleBlock(64, 64)])
@pytest.mark.parametrize("m", [1, 8, 200])
def test_weight_only_blocked(block, m):
    from common.kernels.fp8_linear import fp8_linear

    n, k = 1536, 1024
    torch.manual_seed(0)
    q = (torch.randn(n, k, device=DEV) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(block.grid(n, k), device=DEV) * 1e-3 + 1e-4
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    _check(fp8_linear(x, q, scale, block), _reference(x, q, scale, block, None), 5e-3)


def _per_channel_case(m: int, n: int, k: int, bias: bool, seed: int):
    torch.manual_seed(seed)
    q, scale = quantize_per_channel(torch.randn(n, k, device=DEV) / k**0.5)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    return x, q, scale, b


def _blocked_case(m: int, n: int, k: int, block: ScaleBlock, seed: int):
    torch.manual_seed(seed)
    q = (torch.randn(n, k, device=DEV) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(block.grid(n, k), device=DEV) * 1e-3 + 1e-4
    return torch.randn(m, k, device=DEV, dtype=torch.bfloat16), q, scale


SPLIT_SHAPES = [(4096, 4096), (1000, 352), (4096, 11008), (12288, 4096)]


@pytest.mark.parametrize("m", [2, 3, 8, 16, 32, 33, 64])
@pytest.mark.parametrize("n, k", SPLIT_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_autotuned_per_channel(m, n, k, bias):
    """2..64 rows take the split-K kernel (autotuned) and match the reference."""
    from common.kernels.fp8_linear import weight_only_fp8
    from common.kernels.fp8_split_k import split_k_fp8

    x, q, scale, b = _per_channel_case(m, n, k, bias, m + n + k)
    ref = _reference(x, q, scale, per_channel_block(k), b)
    out = weight_only_fp8(x, q, scale, per_channel_block(k), b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _check(out, ref, 5e-3)
    _check(split_k_fp8(x, q, scale, per_channel_block(k), b), ref, 5e-3)


def _split_configs() -> list[dict]:
    try:
        from common.kernels.fp8_split_k import split_k_configs
    except ImportError:  # no triton: the module is skipped anyway
        return []
    return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in split_k_configs("1")]


@pytest.mark.parametrize("config", _split_configs(),
                         ids=lambda c: "n{BLOCK_N}k{BLOCK_K}s{SPLIT_K}p{}w{num_warps}x{SWAP_AB:d}".format(
                             c.get("PROGRAMS_PER_SM", 0), **c))
@pytest.mark.parametrize("m", [3, 33])
@pytest.mark.parametrize("n, k", [(1000, 352), (4096, 4096)])
def test_split_k_every_config(config, m, n, k):
    """Each configuration forced (the autotuner may prune some for a shape; all must be right), per
    channel with a bias, and with 128 x 128 scale blocks where BLOCK_K divides 128; two calls give the
    same bits (the partials are summed in split order, never by racing atomics)."""
    from common.kernels.fp8_split_k import split_k_fp8

    x, q, scale, b = _per_channel_case(m, n, k, True, 7)
    out = split_k_fp8(x, q, scale, per_channel_block(k), b, config=config)
    _check(out, _reference(x, q, scale, per_channel_block(k), b), 5e-3)
    assert torch.equal(out, split_k_fp8(x, q, scale, per_channel_block(k), b, config=config))
    if 128 % config["BLOCK_K"] == 0:
        block = ScaleBlock(128, 128)
        xb, qb, sb = _blocked_case(m, n, k, block, 8)
        out = split_k_fp8(xb, qb, sb, block, None, config=config)
        _check(out, _reference(xb, qb, sb, block, None), 5e-3)
        assert torch.equal(out, split_k_fp8(xb, qb, sb, block, None, config=config))


@pytest.mark.parametrize("m", [2, 32, 64])
def test_split_k_block_scaled_autotuned(m):
    from common.kernels.fp8_linear import weight_only_fp8

    block = ScaleBlock(128, 128)
    x, q, scale = _blocked_case(m, 4096, 4096, block, 9)
    _check(weight_only_fp8(x, q, scale, block, None), _reference(x, q, scale, block, None), 5e-3)


# A split-K config and a stream-K one (a grid of 2 programs per SM, tiles shared by up to 8 of them).
FORCED = {"split": dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4),
          "stream": dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, PROGRAMS_PER_SM=2, num_warps=4, num_stages=4)}


@pytest.mark.parametrize("form", sorted(FORCED))
@pytest.mark.parametrize("m", [4, 32])
def test_split_k_in_cuda_graph_is_deterministic(m, form):
    """Captured in a CUDA graph (workspace from the caching allocator, counters reset by the kernel), the
    replays compute the eager results for new inputs, bit for bit, several products per graph."""
    from common.kernels.fp8_linear import weight_only_fp8
    from common.kernels.fp8_split_k import split_k_fp8

    shapes = [(4096, 4096), (1000, 352), (12288, 4096)]
    cases = [_per_channel_case(m, n, k, True, 10 + i) for i, (n, k) in enumerate(shapes)]
    forced = FORCED[form]

    def step():
        outs = [weight_only_fp8(x, q, s, per_channel_block(q.shape[1]), b) for x, q, s, b in cases]
        x, q, s, b = cases[0]
        return outs + [split_k_fp8(x, q, s, per_channel_block(q.shape[1]), b, config=forced)]

    step()  # tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for trial in range(3):
        for x, *_ in cases:
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for got, want in zip(captured, eager, strict=True):
            assert torch.equal(got, want), f"replay {trial} differs from the eager call"
    x, q, s, b = cases[0]
    _check(captured[0], _reference(x, q, s, per_channel_block(q.shape[1]), b), 5e-3)


@pytest.mark.parametrize("form", ["autotuned", "stream"])
def test_a_chain_of_split_k_products_in_a_cuda_graph_reads_each_input_after_it_is_written(form):
    """The split-K kernel is launched early (pdl.py): each product of 32 rows starts before the one before
    has ended (its last programs still summing partials) and must wait before reading that one's output.
    A chain of 16 square products, each reading the last one's output (weights of unit gain, an RMS norm
    every fourth), replayed in a graph with new inputs: the same bits as the chain run eagerly. Autotuned,
    and forced to the stream-K form (whose programs release their successor only after their last tile)."""
    from common.kernels.fp8_linear import weight_only_fp8
    from common.kernels.fp8_split_k import split_k_fp8
    from decoder_svc.model.kernel_dispatch import TritonOps

    cases = [_per_channel_case(32, 4096, 4096, i % 2 == 0, 40 + i) for i in range(4)]
    norm_w = torch.ones(4096, device=DEV, dtype=torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for i in range(16):
            if i % 4 == 3:
                x, _ = TritonOps.rms_norm(x, norm_w, 1e-6)
            _, q, scale, bias = cases[i % 4]
            if form == "stream":
                x = split_k_fp8(x, q, scale, per_channel_block(4096), bias, config=FORCED["stream"])
            else:
                x = weight_only_fp8(x, q, scale, per_channel_block(4096), bias)
        return x

    x = torch.randn(32, 4096, device=DEV, dtype=torch.bfloat16)
    assert_replays_as_eager(chain, x, lambda scale: torch.randn_like(x) * scale)


def test_split_k_old_path_kept():
    """split_k=False still runs the one-pass kernels (benchmarks' A/B); both agree with the reference."""
    from common.kernels.fp8_linear import weight_only_fp8

    x, q, scale, b = _per_channel_case(32, 4096, 4096, True, 11)
    ref = _reference(x, q, scale, per_channel_block(4096), b)
    _check(weight_only_fp8(x, q, scale, per_channel_block(4096), b, split_k=False), ref, 5e-3)
    _check(weight_only_fp8(x, q, scale, per_channel_block(4096), b, split_k=True), ref, 5e-3)


@pytest.mark.parametrize("m", [65, 512, 3000])
def test_scaled_mm_prefill(m):
    from common.kernels.fp8_linear import fp8_linear

    n, k = 4096, 4096
    torch.manual_seed(1)
    q, scale = quantize_per_channel(torch.randn(n, k, device=DEV) / k**0.5)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    # The activations are quantized too (per token, e4m3): about 2**-4 relative per element, averaged.
    _check(fp8_linear(x, q, scale, per_channel_block(k), b), _reference(x, q, scale, per_channel_block(k), b),
           4e-2)


def _served(model_dir, dtype: str, backend: str = "triton", n: int = 24, check_graphs: bool = True,
            **overrides) -> list[list[int]]:
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource
    from tests.oracle import greedy, run_all

    overrides.setdefault("enforce_eager", backend == "torch")
    cfg = EngineConfig(model=model_dir, device=DEV, dtype=dtype, attention_backend=backend,
                       num_kv_blocks=128, **overrides)
    engine = LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))
    for i in range(8):
        engine.add_request(str(i), f"the quick brown fox {i} jumps over", sampling=greedy(n))
    out = run_all(engine)
    if backend == "triton" and check_graphs:
        assert engine.runner.graph_steps > 0
    return [out[str(i)]["tokens"] for i in range(8)]


def test_fp8_checkpoint_on_cuda_fp32_equals_its_twin(tiny_model_dir, tmp_path):
    """fp32 activations take the reference product on the GPU too: the served FP8 checkpoint (graphs,
    Triton attention) gives exactly its dequantized twin's tokens."""
    from tests.quant.fp8_writer import write_fp8_checkpoint

    write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", tmp_path / "twin", "fine-grained")
    assert _served(tmp_path / "fp8", "float32") == _served(tmp_path / "twin", "float32")


def test_fp8_engine_graphs_replay_the_eager_kernels(tiny_model_dir):
    """The FP8 engine on the GPU in bf16 (Triton FP8 kernels): decode steps replayed from CUDA graphs give
    exactly the tokens of the same kernels run eagerly. (How close FP8 stays to bf16 is measured on the
    7B shapes by bench.fp8_accuracy; the kernels' error by the tests above.)"""
    graphs = _served(tiny_model_dir, "bfloat16", quantization="fp8")
    eager = _served(tiny_model_dir, "bfloat16", quantization="fp8", enforce_eager=True, check_graphs=False)
    assert graphs == eager
