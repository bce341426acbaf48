"""The in-place recurrent kernel of the gated delta rule (common/kernels/delta_rule_recurrent.py), run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host): its outputs and the slots it
updates equal the torch reference's recurrent steps (decoder_svc/model/gated_deltanet.py) in fp32, every
other slot is left as it was: one token per row (decode) for grouped key heads, rows in any slot order and
strided row views; sequences of several lengths (an empty one among them) over cu_seqlens, with q and k
normalised by the kernel or given normalised. On the GPU: tests/gpu/test_gated_deltanet_fla_gpu.py runs it
through the engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.delta_rule_recurrent import delta_rule_recurrent_, supports  # noqa: E402
from decoder_svc.model.gated_deltanet import recurrent_gated_delta_rule  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (a CPU host)")

ATOL = 2e-5  # fp32: one step's sums in another order


def _inputs(rows: int, key_heads: int, value_heads: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, key_heads, dk, generator=gen)
    k = torch.randn(rows, key_heads, dk, generator=gen)
    v = torch.randn(rows, value_heads, dv, generator=gen)
    g = -torch.rand(rows, value_heads, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(rows, value_heads, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("key_heads,value_heads,dk,dv,slots", [
    (2, 4, 16, 32, [5, 0, 3]),     # grouped key heads, slots out of order
    (4, 4, 32, 64, [1]),            # one row, two value blocks
    (1, 2, 128, 32, [2, 7, 4, 6]),  # Qwen3.5's key dim
    (2, 4, 16, 48, [4, 1]),         # value blocks of 16
])
def test_equals_the_reference_step_and_touches_only_its_slots(key_heads, value_heads, dk, dv, slots):
    rows = len(slots)
    q, k, v, g, beta = _inputs(rows, key_heads, value_heads, dk, dv)
    pool = torch.randn(8, value_heads, dk, dv, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    index = torch.tensor(slots)
    out = torch.full((rows, value_heads, dv), float("nan"))
    delta_rule_recurrent_(q, k, v, g, beta, pool, index, dk ** -0.5, out)

    ref_out, ref_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                    beta[:, None], before[index])
    torch.testing.assert_close(out, ref_out[:, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(pool[index], ref_state, atol=ATOL, rtol=0)
    others = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("normalize", [True, False])
def test_sequences_over_cu_seqlens(normalize):
    """Sequences of 5, 0, 1 and 17 tokens, each from its slot's state: the reference's recurrent rule over
    each sequence's tokens from that state."""
    lengths, slots = [5, 0, 1, 17], [2, 0, 6, 3]
    key_heads, value_heads, dk, dv = 2, 4, 16, 32
    q, k, v, g, beta = _inputs(sum(lengths), key_heads, value_heads, dk, dv, seed=3)
    if not normalize:  # the adapter's case: normalised by the caller, as the reference does it
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    pool = torch.randn(8, value_heads, dk, dv, generator=torch.Generator().manual_seed(4))
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = torch.full((sum(lengths), value_heads, dv), float("nan"))
    delta_rule_recurrent_(q, k, v, g, beta, pool, torch.tensor(slots), dk ** -0.5, out, cu_seqlens=cu,
                          normalize=normalize)
    for i, slot in enumerate(slots):
        a, b = int(cu[i]), int(cu[i + 1])
        ref_out, ref_state = recurrent_gated_delta_rule(*(x[None, a:b] for x in (q, k, v, g, beta)),
                                                        before[slot:slot + 1])
        torch.testing.assert_close(out[a:b], ref_out[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(pool[slot], ref_state[0], atol=ATOL, rtol=0)  # the empty one: unchanged
    others = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[others], before[others])


def test_fresh_sequences_start_from_zeros_and_empty_ones_leave_a_shared_slot_alone():
    """A hybrid CUDA graph's step: fresh sequences (a zero state, whatever their slot holds), and unused
    empty sequences that name the slot a pad sequence writes: only the pad's state lands there."""
    lengths, slots, fresh = [3, 0, 2, 0, 1], [2, 7, 5, 7, 7], [0, 0, 1, 0, 1]
    key_heads, value_heads, dk, dv = 2, 4, 16, 32
    q, k, v, g, beta = _inputs(sum(lengths), key_heads, value_heads, dk, dv, seed=5)
    pool = torch.randn(8, value_heads, dk, dv, generator=torch.Generator().manual_seed(6))
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full((sum(lengths), value_heads, dv), float("nan"))
    delta_rule_recurrent_(q, k, v, g, beta, pool, torch.tensor(slots), dk ** -0.5, out, cu_seqlens=cu,
                          fresh=torch.tensor(fresh, dtype=torch.int32))
    for i, slot in enumerate(slots):
        a, b = int(cu[i]), int(cu[i + 1])
        if a == b:
            continue
        start = torch.zeros_like(before[slot:slot + 1]) if fresh[i] else before[slot:slot + 1]
        ref_out, ref_state = recurrent_gated_delta_rule(*(x[None, a:b] for x in (q, k, v, g, beta)), start)
        torch.testing.assert_close(out[a:b], ref_out[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(pool[slot], ref_state[0], atol=ATOL, rtol=0)
    others = [s for s in range(pool.shape[0]) if s not in slots]
    assert torch.equal(pool[others], before[others])


def test_snapshots_after_a_row_of_a_sequence():
    """The state after row 2 of the first sequence (its 3rd of 4 tokens) and after the second's last row
    go to snapshot slots 6 and 4; a sequence with -1 takes none (its snapshot slot, 7, stays as it was)."""
    lengths, slots = [4, 2, 3], [0, 1, 2]
    snap_rows, snap_slots = [2, 5, -1], [6, 4, 7]
    key_heads, value_heads, dk, dv = 2, 4, 16, 32
    q, k, v, g, beta = _inputs(sum(lengths), key_heads, value_heads, dk, dv, seed=7)
    pool = torch.randn(8, value_heads, dk, dv, generator=torch.Generator().manual_seed(8))
    before = pool.clone()
    cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    out = torch.empty(sum(lengths), value_heads, dv)
    delta_rule_recurrent_(q, k, v, g, beta, pool, torch.tensor(slots), dk ** -0.5, out, cu_seqlens=cu,
                          snapshot_rows=torch.tensor(snap_rows, dtype=torch.int32),
                          snapshot_slots=torch.tensor(snap_slots))
    for i, slot in enumerate(slots):
        a, b = int(cu[i]), int(cu[i + 1])
        _, ref_state = recurrent_gated_delta_rule(*(x[None, a:b] for x in (q, k, v, g, beta)),
                                                  before[slot:slot + 1])
        torch.testing.assert_close(pool[slot], ref_state[0], atol=ATOL, rtol=0)
        if snap_rows[i] >= 0:
            _, at = recurrent_gated_delta_rule(*(x[None, a:snap_rows[i] + 1] for x in (q, k, v, g, beta)),
                                               before[slot:slot + 1])
            torch.testing.assert_close(pool[snap_slots[i]], at[0], atol=ATOL, rtol=0)
    assert torch.equal(pool[[3, 5, 7]], before[[3, 5, 7]])
    with pytest.raises(ValueError, match="together"):
        delta_rule_recurrent_(q, k, v, g, beta, pool, torch.tensor(slots), dk ** -0.5, out, cu_seqlens=cu,
                              snapshot_rows=torch.tensor(snap_rows, dtype=torch.int32))


def test_rows_of_a_wider_tensor_and_a_bf16_output():
    """q, k, v as views into one projected row (the decode path's split), out in bf16."""
    rows, heads, dk, dv = 3, 2, 16, 32
    mixed = torch.randn(rows, 2 * heads * dk + heads * dv)
    q = mixed[:, :heads * dk].view(rows, heads, dk)
    k = mixed[:, heads * dk:2 * heads * dk].view(rows, heads, dk)
    v = mixed[:, 2 * heads * dk:].view(rows, heads, dv)
    g, beta = -torch.rand(rows, heads), torch.rand(rows, heads)
    pool = torch.randn(4, heads, dk, dv)
    before, index = pool.clone(), torch.tensor([3, 1, 2])
    out = torch.empty(rows, heads, dv, dtype=torch.bfloat16)
    delta_rule_recurrent_(q, k, v, g, beta, pool, index, dk ** -0.5, out)
    ref_out, ref_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                                    beta[:, None], before[index])
    torch.testing.assert_close(out, ref_out[:, 0].to(torch.bfloat16))
    torch.testing.assert_close(pool[index], ref_state, atol=ATOL, rtol=0)


def test_refuses_what_it_cannot_take():
    assert supports(128, 128) and supports(16, 48) and not supports(72, 128) and not supports(128, 40)
    q, k, v, g, beta = _inputs(1, 1, 1, 24, 32)
    with pytest.raises(ValueError, match="power of two"):
        delta_rule_recurrent_(q, k, v, g, beta, torch.zeros(1, 1, 24, 32), torch.tensor([0]), 1.0,
                           torch.empty(1, 1, 32))
    q, k, v, g, beta = _inputs(1, 1, 1, 16, 32)
    with pytest.raises(ValueError, match="contiguous fp32"):
        delta_rule_recurrent_(q, k, v, g, beta, torch.zeros(1, 1, 16, 32, dtype=torch.bfloat16),
                           torch.tensor([0]), 1.0, torch.empty(1, 1, 32))
