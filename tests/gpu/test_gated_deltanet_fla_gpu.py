"""The Gated DeltaNet layer's fla path on a CUDA device (model/gated_deltanet_fla.py) against the torch
reference on the same device: a varlen prefill of several sequences (fresh and resumed from their slots,
snapshots inside chunks) beside decode rows, in fp32 and bf16; the decode step captured in a CUDA graph and
replayed with other rows and slots; and the qwen3.5-tiny engine giving the same greedy tokens with fla as
with the reference (fp32). At these head dims (128) the decode rows and the short prefill pieces take the
in-place kernel (common/kernels/delta_rule_recurrent.py) that load_fla pairs with fla's rules. Skipped
without fla (fla-core)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_svc.model.gated_deltanet import GatedDeltaNet
from decoder_svc.model.gated_deltanet_fla import KERNEL_ENV, load_fla
from tests.oracle import greedy, run_all
from tests.qwen3_5.linear_steps import (
    LAYER,
    build_step,
    clone_pool,
    noisy_pool,
    random_layer,
    rows_input,
    text_shape,
)
from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION

# Relative error ||fla - ref|| / ||ref|| (outputs, recurrent states). fp32: fla's chunked kernels take
# Triton's default fp32 dot, TF32 on Hopper (10-bit mantissa, unit roundoff 2^-11 ~ 5e-4), compounded over
# a few products and chunks: 5e-3. bf16: fla keeps its intermediates (the WY factors, the chunk states'
# products) in bf16 (unit roundoff 2^-8 ~ 4e-3), the reference computes the rule in fp32 from the same
# bf16 inputs: 3e-2 (fla's own tests allow ~5e-3 to 2e-2 for this rule's forward). A state lost or read
# from another slot is off by far more (checked: the resumed outputs differ from fresh ones by > 0.1).
FP32_REL = 5e-3
BF16_REL = 3e-2

# Several sequences: fresh and resumed, lengths inside and across fla's 64-token blocks, a decode row
# between them, snapshots inside chunks (the call cut there) and at a chunk's end.
MIXED = [
    (200, 0, 0, ((64, 9), (150, 10))), (1, 40, 1, ()), (17, 33, 2, ()), (333, 0, 3, ((333, 11),)),
    (1, 5, 4, ()), (64, 128, 5, ()), (1, 0, 6, ()), (90, 7, 7, ((1, 12),)),
]
SLOTS = 13
DEVICE = "cuda"
DECODE = [(1, 9, 3, ()), (1, 40, 0, ()), (1, 2, 7, ()), (1, 300, 5, ())]


@pytest.fixture(scope="module")
def fla_kernels():
    kernels, why = load_fla()
    if kernels is None:
        pytest.skip(f"fla does not import: {why}")
    return kernels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _sequences(layout: list[tuple]) -> list[tuple[int, int]]:
    """Each sequence's rows [lo, hi) in a step of `layout`."""
    bounds, row = [], 0
    for n, *_ in layout:
        bounds.append((row, row + n))
        row += n
    return bounds


def _shape():
    """The real head dims (128) at few heads; key heads serving 2 value heads each."""
    return text_shape(key_dim=128, value_dim=128, hidden=256, key_heads=2, value_heads=4)


def _run(layer: GatedDeltaNet, kernels, pool, layout, seed: int, dtype: torch.dtype):
    layer.kernels = kernels
    step, rows = build_step(pool, layout, DEVICE)
    x = rows_input(rows, layer.shape.hidden_size, seed, DEVICE, dtype)
    with torch.no_grad():
        return layer.forward_batch(x, step, LAYER)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_prefill_and_decode_rows_equal_the_reference(fla_kernels, dtype):
    shape = _shape()
    layer = random_layer(shape, device=DEVICE, dtype=dtype)
    pool = noisy_pool(shape, device=DEVICE, dtype=dtype, slots=SLOTS)
    ref_pool, fla_pool = clone_pool(pool), clone_pool(pool)
    bound = FP32_REL if dtype == torch.float32 else BF16_REL
    for i, layout in enumerate([MIXED, DECODE, [(70, 10, 3, ()), (1, 201, 0, ())]]):
        ref = _run(layer, None, ref_pool, layout, 10 + i, dtype)
        out = _run(layer, fla_kernels, fla_pool, layout, 10 + i, dtype)
        assert out.dtype == dtype
        for lo, hi in _sequences(layout):  # each sequence, and its first tokens (where its state shows most)
            for a, b in ((lo, hi), (lo, min(hi, lo + 8))):
                assert _rel(out[a:b], ref[a:b]) < bound, (i, a, b, _rel(out[a:b], ref[a:b]))
        written = {slot for *_, slot, _ in layout} | {s for *_, snaps in layout for _, s in snaps}
        for slot in sorted(written):
            got, want = fla_pool.recurrent[LAYER][slot], ref_pool.recurrent[LAYER][slot]
            assert _rel(got, want) < bound, (i, slot, _rel(got, want))
        # the conv states are the projections' own values (whoever convolves them): equal
        assert torch.equal(fla_pool.conv[LAYER], ref_pool.conv[LAYER])
    # the tolerance can see a state: the first tokens of a resumed sequence from a zero state are far off
    resumed = [(n, start, slot, ()) for n, start, slot, _ in MIXED if n > 1 and start > 0]
    fresh = [(n, 0, slot, ()) for n, _, slot, _ in resumed]
    a = _run(layer, fla_kernels, clone_pool(pool), fresh, 3, dtype)
    b = _run(layer, fla_kernels, clone_pool(pool), resumed, 3, dtype)
    for lo, _ in _sequences(resumed):
        assert _rel(a[lo:lo + 8], b[lo:lo + 8]) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_snapshots_from_chunk_states_equal_a_cut_call(fla_kernels, dtype):
    """Snapshots on 64-token bounds read from fla's chunk states (model/fla_chunk_states.py) give what a
    prefill cut there gives: outputs, the snapshot slots and the sequences' own slots, in fp32 and bf16. The
    same arithmetic on the same chunks: bit for bit unless the autotuner picks another configuration for the
    state kernel with fp32 states than with the inputs' dtype (printed; a state read from the wrong chunk is
    off by orders of magnitude more than the bound)."""
    from dataclasses import replace

    from tests.qwen3_5.linear_steps import LAYOUTS

    shape = _shape()
    layer = random_layer(shape, device=DEVICE, dtype=dtype)
    pool = noisy_pool(shape, device=DEVICE, dtype=dtype, slots=SLOTS)
    layout = LAYOUTS["snapshots on chunk bounds"] + [(300, 0, 11, ((64, 12), (256, 10)))]
    states_pool, cut_pool = clone_pool(pool), clone_pool(pool)
    got = _run(layer, fla_kernels, states_pool, layout, 4, dtype)
    want = _run(layer, replace(fla_kernels, chunk_states=None), cut_pool, layout, 4, dtype)
    bound = 1e-5 if dtype == torch.float32 else 1e-3
    assert _rel(got, want) < bound
    for key in pool.recurrent:
        assert _rel(states_pool.recurrent[key], cut_pool.recurrent[key]) < bound
        assert torch.equal(states_pool.conv[key], cut_pool.conv[key])
    same_states = all(torch.equal(states_pool.recurrent[k], cut_pool.recurrent[k]) for k in pool.recurrent)
    print(f"chunk states vs cut calls, {dtype}: outputs equal bits {torch.equal(got, want)}, states equal "
          f"bits {same_states}")


def test_chunk_with_states_is_flas_rule_with_its_inner_states(fla_kernels):
    """chunk_with_states' output and final states are fla's chunked rule's, and its state at chunk m of a
    sequence is the final state fla gives for the sequence's first 64 m tokens (bf16 inputs; equal bits
    printed, as in the test above)."""
    from decoder_svc.model.fla_chunk_states import chunk_with_states

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lengths, heads, dim = [200, 64, 130], 4, 128
    total = sum(lengths)
    def rows() -> torch.Tensor:
        return torch.randn(1, total, heads, dim, device=DEVICE, generator=gen)

    q, k = (torch.nn.functional.normalize(rows(), dim=-1).to(torch.bfloat16) for _ in "qk")
    v = rows().to(torch.bfloat16)
    g = -torch.rand(1, total, heads, device=DEVICE, generator=gen)
    beta = torch.rand(1, total, heads, device=DEVICE, generator=gen).to(torch.bfloat16)
    h0 = 0.3 * torch.randn(len(lengths), heads, dim, dim, device=DEVICE, generator=gen)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, device=DEVICE)
    o, final, states = chunk_with_states(q, k, v, g=g, beta=beta, scale=dim ** -0.5, initial_state=h0,
                                         cu_seqlens=cu)
    ref_o, ref_final = fla_kernels.chunk(q, k, v, g=g, beta=beta, scale=dim ** -0.5, initial_state=h0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=False,
                                         cu_seqlens=cu)
    assert _rel(o, ref_o) < 1e-3 and _rel(final, ref_final) < 1e-3
    equal = [torch.equal(o, ref_o), torch.equal(final, ref_final)]
    index = 0
    for i, n in enumerate(lengths):
        a = bounds[i]
        for m in range(-(-n // 64)):
            if m == 0:
                assert torch.equal(states[index], h0[i])
            else:
                t = slice(a, a + 64 * m)
                _, before = fla_kernels.chunk(q[:, t], k[:, t], v[:, t], g=g[:, t], beta=beta[:, t],
                                              scale=dim ** -0.5, initial_state=h0[i:i + 1],
                                              output_final_state=True, use_qk_l2norm_in_kernel=False,
                                              cu_seqlens=torch.tensor([0, 64 * m], device=DEVICE))
                assert _rel(states[index], before[0]) < 1e-3, (i, m)
                equal.append(torch.equal(states[index], before[0]))
            index += 1
    assert index == states.shape[0]
    print(f"chunk_with_states vs fla's rule: output, final states, inner states equal bits {equal}")


def test_decode_step_replays_in_a_cuda_graph(fla_kernels):
    """The decode step captured once, the pool and the slot tensor its inputs: replays with new rows and
    other slots give the eager fla step's bits, and the reference's values."""
    shape = _shape()
    layer = random_layer(shape, device=DEVICE)
    layer.kernels = fla_kernels
    pool = noisy_pool(shape, device=DEVICE, slots=SLOTS)
    start = clone_pool(pool)
    step, rows = build_step(pool, DECODE, DEVICE)
    x = rows_input(rows, shape.hidden_size, 1, DEVICE)
    with torch.no_grad():
        layer.forward_batch(x, step, LAYER)  # compiles fla's kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.forward_batch(x, step, LAYER)
        for trial, slots in enumerate([[3, 0, 7, 5], [12, 1, 2, 9], [0, 3, 5, 7]]):
            for key in pool.conv:  # the pool as it was, in place: the graph reads these tensors
                pool.conv[key].copy_(start.conv[key])
                pool.recurrent[key].copy_(start.recurrent[key])
            x.copy_(rows_input(rows, shape.hidden_size, 100 + trial, DEVICE))
            step.decode_slots.copy_(torch.tensor(slots, device=DEVICE))
            eager_pool, ref_pool = clone_pool(pool), clone_pool(pool)
            eager_step, _ = build_step(eager_pool, [(1, 9, s, ()) for s in slots], DEVICE)
            eager = layer.forward_batch(x.clone(), eager_step, LAYER)
            layer.kernels = None
            ref_step, _ = build_step(ref_pool, [(1, 9, s, ()) for s in slots], DEVICE)
            ref = layer.forward_batch(x.clone(), ref_step, LAYER)
            layer.kernels = fla_kernels
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), trial
            assert torch.equal(pool.recurrent[LAYER], eager_pool.recurrent[LAYER])
            assert torch.equal(pool.conv[LAYER], eager_pool.conv[LAYER])
            assert _rel(out, ref) < FP32_REL
            assert _rel(pool.recurrent[LAYER], ref_pool.recurrent[LAYER]) < FP32_REL


# ---- the engine end to end ----

N = 10
# fp32 with TF32 products inside fla: logprobs agree to ~1e-3; greedy tokens equal unless the reference's
# two best tokens are nearly tied (then fla may take the other one, and the rest of the text differs).
LOGPROB_ATOL = 1e-2
NEAR_TIE = 1e-2


def _engine(model_dir: Path, budget: int, device: str = DEVICE):
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource

    config = EngineConfig(model=model_dir, device=device, dtype="float32", num_kv_blocks=512,
                          max_num_batched_tokens=budget)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def _serve(model_dir: Path, images: list, budget: int, mode: str, monkeypatch) -> dict:
    """Concurrent text and image requests, then a new question about an image seen before (resumed from
    the snapshot at the image's end): per request id the tokens, top-2 logprobs and usage."""
    monkeypatch.setenv(KERNEL_ENV, mode)
    engine = _engine(model_dir, budget)
    linear = [m for m in engine.runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert linear and all((m.delta_rule_kernels(torch.device(DEVICE)) is not None) == (mode == "fla")
                          for m in linear)
    plan = {"text": (TEXT, []), "one": (ONE, images[:1]), "two": (TWO, images[::2])}
    for rid, (prompt, imgs) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(N, logprobs=2))
    results = run_all(engine)
    warm = USER + VISION + "which colours are there?" + END  # "one"'s image, another question
    engine.add_request("warm", warm, images[:1], sampling=greedy(N, logprobs=2))
    results.update(run_all(engine))
    assert results["warm"]["usage"].cached_prompt_tokens > 0  # resumed from the image's snapshot
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    return results


def _assert_same_greedy(got: dict, ref: dict, rid: str) -> None:
    """got's tokens are ref's, or part from them only where ref's two best were nearly tied (taking ref's
    second); the chosen tokens' logprobs agree up to there."""
    for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"], strict=True)):
        mine, theirs = got["logprobs"][i], ref["logprobs"][i]
        if a != b:
            gap = theirs.top_logprobs[0] - theirs.top_logprobs[1]
            assert gap < NEAR_TIE and a == theirs.top_ids[1], f"{rid}: token {i} differs (gap {gap:.2e})"
            return
        assert abs(mine.logprob - theirs.logprob) < LOGPROB_ATOL, (rid, i, mine.logprob, theirs.logprob)


@pytest.mark.parametrize("budget", [13, 2048])
def test_engine_with_fla_gives_the_reference_s_greedy_tokens(qwen3_5_model_dir, qwen_images, budget,
                                                              monkeypatch):
    """fp32 on CUDA; budget 13 cuts images and carries the linear layers' state across chunks."""
    ref = _serve(qwen3_5_model_dir, qwen_images, budget, "torch", monkeypatch)
    got = _serve(qwen3_5_model_dir, qwen_images, budget, "fla", monkeypatch)
    assert set(got) == set(ref)
    for rid in ref:
        assert got[rid]["error"] is None and ref[rid]["error"] is None
        _assert_same_greedy(got[rid], ref[rid], rid)
