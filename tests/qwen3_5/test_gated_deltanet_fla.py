"""The Gated DeltaNet layer's kernel seam on a CPU (model/gated_deltanet_fla.py): which path a layer takes,
and the fla adapter's bookkeeping (chunks packed with cu_seqlens, slot states gathered and written back,
calls cut at snapshot positions, decode rows of several slots) run over fla's calling convention computed
by the torch reference (tests/qwen3_5/linear_steps.py's FakeFla): outputs and every slot equal to the
reference path's up to fp32 rounding. fla's own kernels are checked on the GPU
(tests/gpu/test_gated_deltanet_fla_gpu.py)."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from decoder_svc.model.gated_deltanet_fla import (
    FLA_CHUNK,
    KERNEL_ENV,
    SHORT_PIECE,
    DeltaRuleKernels,
    PrefillPlan,
    kernels_for,
    linear_attention_mode,
)
from decoder_svc.model.linear_state import LinearChunk
from tests.qwen3_5.linear_steps import (
    LAYER,
    LAYOUTS,
    FakeFla,
    build_step,
    clone_pool,
    noisy_pool,
    random_layer,
    rows_input,
    text_shape,
)

# Packed and per-piece convolutions, and batched and single decode rows, round differently: outputs of
# size ~1 and states agree to ~5e-7 (measured); a state read from the wrong slot, or noise read for a
# fresh sequence, is off by ~0.1 or more.
ATOL = 5e-6
KERNELS_ATOL = 2e-5  # with the Triton kernels (gates, output norm): their fp32 sums in another order

CUDA = torch.device("cuda")  # kernels_for only reads the device's type: no GPU needed


def _no_fla():
    return None, "ImportError: No module named 'fla'"


def _fake_fla():
    return FakeFla().kernels(), ""


def test_auto_takes_the_reference_on_a_cpu_and_fla_on_cuda_when_it_imports(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert linear_attention_mode() == "auto"
    assert kernels_for(torch.device("cpu"), load=_fake_fla) is None
    assert kernels_for(CUDA, load=_fake_fla).name == "fake"
    assert kernels_for(CUDA, load=_no_fla) is None  # auto without fla: the reference, no error
    assert kernels_for(CUDA, "torch", load=_fake_fla) is None
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert kernels_for(CUDA, load=_fake_fla) is None


def test_forcing_fla_without_cuda_or_without_fla_is_a_clear_error(monkeypatch):
    with pytest.raises(RuntimeError, match=f"{KERNEL_ENV}=fla needs a CUDA device.*runs on cpu"):
        kernels_for(torch.device("cpu"), "fla", load=_fake_fla)
    with pytest.raises(RuntimeError, match=f"{KERNEL_ENV}=fla but fla .* does not import: ImportError"):
        kernels_for(CUDA, "fla", load=_no_fla)
    monkeypatch.setenv(KERNEL_ENV, "flash")
    with pytest.raises(ValueError, match=f"{KERNEL_ENV} must be one of auto, torch, fla"):
        kernels_for(CUDA, load=_fake_fla)


def test_a_layer_resolves_the_mode_once_per_device(monkeypatch):
    import decoder_svc.model.gated_deltanet as gdn
    calls = []
    monkeypatch.setattr(gdn, "kernels_for", lambda device: calls.append(device) or None)
    layer = random_layer(text_shape())
    for _ in range(3):
        assert layer.delta_rule_kernels(torch.device("cpu")) is None
    assert calls == [torch.device("cpu")]  # not once per layer per step
    layer.delta_rule_kernels(CUDA)
    assert calls == [torch.device("cpu"), CUDA]  # another device: resolved again


@torch.no_grad()
def test_a_layer_forced_to_fla_on_a_cpu_refuses_to_run(monkeypatch):
    shape = text_shape()
    layer = random_layer(shape)
    pool = noisy_pool(shape)
    step, rows = build_step(pool, LAYOUTS["one fresh chunk"])
    x = rows_input(rows, shape.hidden_size)
    monkeypatch.setenv(KERNEL_ENV, "fla")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        layer.forward_batch(x, step, LAYER)
    monkeypatch.setenv(KERNEL_ENV, "auto")
    assert layer.delta_rule_kernels(x.device) is None  # the reference, as before the seam
    layer.forward_batch(x, step, LAYER)


def test_the_plan_packs_chunks_and_cuts_them_at_snapshots():
    """Two chunks (rows 2..7 and 9..11) after a decode row, conv kernel 3 (2 carried inputs each); the
    first asks for snapshots after 2 and 5 (its end) tokens, so two rounds: its two pieces, the second
    chunk whole in the first round."""
    chunks = (LinearChunk(2, 7, 0, True, ((2, 4), (5, 5))), LinearChunk(9, 12, 1, False))
    plan = PrefillPlan.of(chunks, taps=3)
    assert plan.rows == [2, 3, 4, 5, 6, 9, 10, 11]
    assert plan.offsets == [0, 7] and plan.carried == 4
    # chunk 0: carried inputs 0, 1 then packed rows 0..4; chunk 1: carried 2, 3 then packed rows 5..7
    assert plan.columns == [0, 1, 4, 5, 6, 7, 8, 2, 3, 9, 10, 11]
    assert plan.conv_out == [0, 1, 2, 3, 4, 7, 8, 9]  # each row's window ends on its own column
    first, second = plan.rounds
    assert (first.positions, first.chunks, first.ends, first.cu_seqlens, first.keep) == (
        [0, 1, 5, 6, 7], [0, 1], [2, 3], [0, 2, 5], None)
    # after the first call: chunk 0's state at 2 tokens to snapshot slot 4 (its conv state: the 2 inputs
    # before its token 2, columns 2 and 3), chunk 1's final state to its own slot 1 (columns 10 and 11)
    assert (first.sources, first.starts, first.dsts) == ([0, 1], [2, 10], [4, 1])
    assert (second.positions, second.chunks, second.ends, second.cu_seqlens, second.keep) == (
        [2, 3, 4], [0], [5], [0, 3], [0])
    assert (second.sources, second.starts, second.dsts) == ([0, 0], [5, 5], [5, 0])  # snapshot 5, own slot 0


def _run(layout: list[tuple], kernels: DeltaRuleKernels | None, pool, seed: int = 2, shape=None):
    shape = shape or text_shape()
    layer = random_layer(shape)
    layer.kernels = kernels
    step, rows = build_step(pool, layout)
    return layer.forward_batch(rows_input(rows, shape.hidden_size, seed), step, LAYER)


def _assert_pools_close(mine, ref) -> None:
    assert torch.allclose(mine.recurrent[LAYER], ref.recurrent[LAYER], atol=ATOL, rtol=0)
    assert torch.allclose(mine.conv[LAYER], ref.conv[LAYER], atol=ATOL, rtol=0)


def _split(n: int, snapshots: tuple, state_chunk: int) -> tuple[int, set[int]]:
    """(calls, snapshot offsets read from chunk states) of a chunk of n tokens: one call more per snapshot
    before its end, but for those a whole number of state chunks after the previous cut."""
    cuts, last, inner = 1, 0, set()
    for k in sorted({k for k, _ in snapshots if k < n}):
        if state_chunk and (k - last) % state_chunk == 0:
            inner.add(k)
        else:
            cuts, last = cuts + 1, k
    return cuts, inner


@torch.no_grad()
@pytest.mark.parametrize("states", [True, False], ids=["chunk-states", "cuts-only"])
@pytest.mark.parametrize("in_place", [False, True], ids=["fla-decode", "in-place-decode"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_adapter_equals_the_reference_path(name, in_place, states):
    """in_place: decode rows and short rounds through the in-place kernel (value dims in blocks of 16);
    states: snapshots on 64-token bounds read from the chunked rule's chunk states, not cut."""
    if in_place:
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the kernel runs in Triton's interpreter here (a CPU host)")
    layout = LAYOUTS[name]
    shape = text_shape(value_dim=16 if in_place else 8)
    pool = noisy_pool(shape)
    ref_pool, fla_pool = clone_pool(pool), clone_pool(pool)
    fake = FakeFla(in_place=in_place, states=states)
    ref = _run(layout, None, ref_pool, shape=shape)
    out = _run(layout, fake.kernels(), fla_pool, shape=shape)
    assert torch.allclose(out, ref, atol=KERNELS_ATOL if in_place else ATOL, rtol=0)
    _assert_pools_close(fla_pool, ref_pool)
    # every slot a sequence or snapshot of the step names was written; the others kept what they held
    written = {slot for _, _, slot, _ in layout} | {s for *_, snaps in layout for _, s in snaps}
    for slot in set(range(pool.num_slots)) - written:
        assert torch.equal(fla_pool.recurrent[LAYER][slot], pool.recurrent[LAYER][slot])
        assert torch.equal(fla_pool.conv[LAYER][slot], pool.conv[LAYER][slot])
    for slot in written:
        assert not torch.allclose(fla_pool.recurrent[LAYER][slot], pool.recurrent[LAYER][slot], atol=1e-3)
    # one call for the whole step's chunks, or one per piece of the most-cut chunk (rounds), each a chunked
    # call, or with the in-place kernel one launch where the round's pieces are short; one decode call
    chunks = [snaps for n, start, _, snaps in layout if not (n == 1 and start > 0 and not snaps)]
    state_chunk = FLA_CHUNK if states else 0
    splits = [_split(n, snaps, state_chunk) for n, _, _, snaps in layout]
    pieces = max((calls for (calls, _), (*_, snaps) in zip(splits, layout, strict=True) if snaps), default=1)
    rounds = pieces if chunks else 0
    step, _ = build_step(pool, layout)
    plan = PrefillPlan.of(step.chunks, 4, state_chunk)
    longest = [max(b - a for a, b in zip(r.cu_seqlens, r.cu_seqlens[1:], strict=False)) for r in plan.rounds]
    # each snapshot on a bound read from its round's chunk states, in one call of that round
    on_bounds = sum(k in inner for (_, inner), (*_, snaps) in zip(splits, layout, strict=True)
                    for k, _ in snaps)
    assert sum(len(r.inner_dsts) for r in plan.rounds) == on_bounds
    assert len(fake.state_calls) == sum(bool(r.inner_dsts) for r in plan.rounds)
    assert (on_bounds > 0) == (states and name == "snapshots on chunk bounds")
    assert len(longest) == rounds
    short = sum(n <= SHORT_PIECE for n in longest) if in_place else 0
    assert len(fake.chunk_calls) == rounds - short
    first_chunked = next((i for i, n in enumerate(longest) if not (in_place and n <= SHORT_PIECE)), None)
    if first_chunked == 0:
        assert fake.chunk_calls[0] == len(chunks)  # every chunk in the first call
    decodes = len(layout) - len(chunks)
    prefill_launches = [c for c in fake.in_place_calls if c[2]]
    assert len(prefill_launches) == short
    if in_place:
        assert fake.recurrent_calls == []
        assert fake.in_place_calls.count((decodes, decodes, False)) == (decodes > 0)
    else:
        assert fake.recurrent_calls == ([decodes] if decodes else []) and fake.in_place_calls == []


@torch.no_grad()
def test_a_sequence_through_several_steps_equals_the_reference_path():
    """Prefill (with a snapshot), decode steps beside a new request's prefill, a later chunk resumed from
    the slot, then a request resumed from the snapshot (copied into its slot): both paths in step."""
    shape = text_shape()
    layers = {kind: random_layer(shape) for kind in ("ref", "fla")}
    layers["fla"].kernels = FakeFla().kernels()
    layers["ref"].kernels = None
    pools = {kind: noisy_pool(shape) for kind in layers}
    steps = [
        [(90, 0, 0, ((64, 6),))],
        [(1, 90, 0, ()), (33, 0, 1, ())],
        [(1, 91, 0, ()), (1, 33, 1, ())],
        [(20, 92, 0, ((7, 7),)), (1, 34, 1, ())],
    ]
    for i, layout in enumerate(steps):
        outs = {}
        for kind, layer in layers.items():
            step, rows = build_step(pools[kind], layout)
            outs[kind] = layer.forward_batch(rows_input(rows, shape.hidden_size, seed=10 + i), step, LAYER)
        assert torch.allclose(outs["fla"], outs["ref"], atol=ATOL, rtol=0), f"step {i}"
        _assert_pools_close(pools["fla"], pools["ref"])
    for kind, pool in pools.items():
        pool.copy_slots([(6, 2)])  # a new request resumes from the snapshot at 64 tokens
        step, rows = build_step(pool, [(26, 64, 2, ())])
        outs[kind] = layers[kind].forward_batch(rows_input(rows, shape.hidden_size, seed=20), step, LAYER)
    assert torch.allclose(outs["fla"], outs["ref"], atol=ATOL, rtol=0)
    _assert_pools_close(pools["fla"], pools["ref"])


@torch.no_grad()
def test_a_step_of_fresh_chunks_gathers_no_state():
    """Every chunk starts its sequence: fla's chunked rule starts from zeros itself (initial_state None),
    whatever the slots hold; a step with a resumed chunk hands over the gathered states."""
    fake = FakeFla()
    _run(LAYOUTS["fresh chunks of several lengths"], fake.kernels(), noisy_pool(text_shape()))
    assert [kwargs["initial_state"] for rule, _, kwargs in fake.calls if rule == "chunk"] == [None]
    fake = FakeFla()
    _run(LAYOUTS["resumed and fresh chunks between decode rows"], fake.kernels(), noisy_pool(text_shape()))
    assert all(kwargs["initial_state"] is not None for _, _, kwargs in fake.calls)


@torch.no_grad()
def test_the_calls_bind_to_fla_s_own_signatures():
    """Where fla is installed (it imports on a CPU; its kernels do not run there): every argument of the
    adapter's calls lands on the parameter of that name (fla's recurrent rule has gk and gv between g and
    beta), with the shapes and dtypes fla documents."""
    ops = pytest.importorskip("fla.ops.gated_delta_rule")
    fake = FakeFla()
    _run(LAYOUTS["snapshots inside chunks"], fake.kernels(), noisy_pool(text_shape()))
    rules = {"chunk": ops.chunk_gated_delta_rule, "recurrent": ops.fused_recurrent_gated_delta_rule}
    assert {rule for rule, _, _ in fake.calls} == set(rules)
    for rule, args, kwargs in fake.calls:
        bound = inspect.signature(rules[rule]).bind(*args, **kwargs).arguments
        q, k, v, g, beta, state = (bound[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
        assert q.shape == k.shape and q.shape[:2] == v.shape[:2] and g.shape == beta.shape == v.shape[:3]
        assert g.dtype == state.dtype == torch.float32
        assert state.shape[1:] == (v.shape[2], q.shape[3], v.shape[3])
        # the chunked rule gets q and k normalised (fla's l2norm kernel compiles per row count)
        assert bound["use_qk_l2norm_in_kernel"] == (rule == "recurrent") and bound["output_final_state"]
        assert bound["scale"] == q.shape[-1] ** -0.5
        seqs = q.shape[0] if bound["cu_seqlens"] is None else len(bound["cu_seqlens"]) - 1
        assert state.shape[0] == seqs and (bound["cu_seqlens"] is None or q.shape[0] == 1)



@pytest.mark.parametrize("in_place", [False, True], ids=["fla-decode", "in-place-kernel"])
def test_the_engine_through_the_adapter_gives_hf_s_tokens(make_qwen3_5_engine, qwen3_5_oracle, qwen_images,
                                                          monkeypatch, in_place):
    """The tiny checkpoint's engine with every linear layer on the adapter (fla's contract in torch):
    concurrent text and image requests in chunks that cut images, a new question about a seen image
    resumed from its snapshot, then a fresh request in a slot another one left; tokens equal HF's generate
    and the first token's logprob HF's to 1e-4 (a state resumed wrongly can still give the same tokens)."""
    from tests.oracle import waves_equal_hf
    from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION

    if in_place and (torch.cuda.is_available() or importlib.util.find_spec("triton") is None):
        pytest.skip("the in-place kernel runs in Triton's interpreter here (a CPU host)")
    fake = FakeFla(in_place=in_place)
    monkeypatch.setattr("decoder_svc.model.gated_deltanet.kernels_for", lambda device: fake.kernels())
    # chunks that cut images; with the Triton kernels (the interpreter's pace) fewer, all still short
    engine = make_qwen3_5_engine(max_num_batched_tokens=29 if in_place else 13)
    waves = [{"text": (TEXT, []), "one": (ONE, qwen_images[:1]), "two": (TWO, [qwen_images[0]] * 2)},
             {"warm": (USER + VISION + "which colours are there?" + END, qwen_images[:1])},
             {"fresh": (USER + "describe a blue boat on the sea" + END, [])}]
    results = waves_equal_hf(engine, qwen3_5_oracle, waves, 6)
    assert results["warm"]["usage"].cached_prompt_tokens > 0  # resumed from the image's snapshot
    if in_place:  # 29-token steps: every piece short, chunks packed into one launch, decode rows too
        assert not fake.chunk_calls and not fake.recurrent_calls
        assert max(seqs for rows, seqs, varlen in fake.in_place_calls if varlen) > 1
        assert any(not varlen for *_, varlen in fake.in_place_calls)
    else:
        assert fake.chunk_calls and fake.recurrent_calls and max(fake.chunk_calls) > 1  # chunks packed
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
