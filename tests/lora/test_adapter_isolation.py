"""One adapter's values never reach rows that do not run it: the batched product selects each row's slot
rather than multiplying the others by zero (0 x NaN is NaN), in the torch reference, the stacked GEMMs and
the gathering kernels (Triton's interpreter on a CPU host), and through a whole engine with a NaN adapter
loaded that no request names. The load refuses such an adapter (test_adapter_checks.py); these tests put
the NaN in past the load, as an activation overflow would put an Inf in the product."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from decoder_svc.model.lora import LoRALinear, LoRASlots  # noqa: E402
from decoder_svc.model.lora.reference import lora_add_reference  # noqa: E402
from tests.lora.test_lora_engine import TEXT  # noqa: E402
from tests.oracle import greedy, run_all  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANK, N, K = 4, 40, 48


def _weights(dtype=torch.float32):
    """Three slots after the base model's; slot 3's A and B poisoned with NaN and Inf, and the clean copy."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(4 * RANK, K, generator=gen), torch.randn(N, 4 * RANK, generator=gen)
    a[:RANK], b[:, :RANK] = 0, 0
    clean = (a.to(DEVICE, dtype), b.to(DEVICE, dtype))
    a, b = a.clone(), b.clone()
    a[3 * RANK], b[0, 3 * RANK + 1] = float("nan"), float("inf")
    a[3 * RANK + 2, 5] = float("inf")
    return clean, (a.to(DEVICE, dtype), b.to(DEVICE, dtype))


def _inputs(rows: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen).to(DEVICE, dtype)
    y = torch.randn(rows, N, generator=gen).to(DEVICE, dtype)
    slots = (torch.arange(rows) % 3).to(DEVICE)  # slots 0, 1, 2: nobody runs slot 3
    return x, y, slots


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_reference_rows_never_meet_an_adapter_they_do_not_run(rows):
    (a, b), (bad_a, bad_b) = _weights()
    x, y, slots = _inputs(rows)
    want = lora_add_reference(y, x, a, b, slots, RANK)
    got = lora_add_reference(y, x, bad_a, bad_b, slots, RANK)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    poisoned = lora_add_reference(y, x, bad_a, bad_b, torch.full_like(slots, 3), RANK)
    assert not torch.isfinite(poisoned).all()  # the poison is there for the rows that run it


@pytest.mark.parametrize("rows", [2, 9])  # the gathering kernels; the stacked GEMMs (> GATHER_MAX_ROWS)
def test_triton_rows_never_meet_an_adapter_they_do_not_run(rows):
    pytest.importorskip("triton")
    from common.kernels.lora import lora_add_triton

    (a, b), (bad_a, _) = _weights()
    x, y, slots = _inputs(rows)
    want = lora_add_triton(y.clone(), x, a, b, slots, RANK)
    # NaN and Inf in slot 3's A (B's are refused at load: check_finite), and then an Inf product alone
    got = lora_add_triton(y.clone(), x, bad_a, b, slots, RANK)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    big = a.clone()
    big[3 * RANK:] = 3e38  # finite weights whose product with any row overflows
    got = lora_add_triton(y.clone(), x, big, b, slots, RANK)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_the_gathering_kernels_skip_a_poisoned_b_too():
    pytest.importorskip("triton")
    from common.kernels.lora import lora_add_triton

    (a, b), (bad_a, bad_b) = _weights()
    x, y, slots = _inputs(3)
    want = lora_add_triton(y.clone(), x, a, b, slots, RANK)
    assert torch.equal(lora_add_triton(y.clone(), x, bad_a, bad_b, slots, RANK), want)


def test_bind_forgets_the_previous_forwards_adapter_rows():
    """adapter_rows is made once per forward: a new bind must not serve the last forward's rows."""
    pytest.importorskip("triton")
    from common.kernels.lora import one_hot_adapters

    slots = LoRASlots(3)
    first, second = torch.tensor([1, 1, 2, 0, 3]), torch.tensor([0, 3, 3, 2, 1])
    slots.bind(first, 5)
    torch.testing.assert_close(slots.adapter_rows(torch.float32), one_hot_adapters(first, 3, torch.float32))
    slots.bind(second, 5)
    torch.testing.assert_close(slots.adapter_rows(torch.float32), one_hot_adapters(second, 3, torch.float32))
    slots.bind(None, 5)
    assert not slots.active


def _poison_slot(engine, slot: int) -> None:
    """NaN in every A and B column of `slot` of every wrapped projection (past the load's checks)."""
    for module in engine.model.modules():
        if isinstance(module, LoRALinear):
            cols = slice(slot * module.rank, (slot + 1) * module.rank)
            module.lora_a[cols] = float("nan")
            module.lora_b[:, cols] = float("nan")


def test_a_nan_adapter_nobody_asks_for_changes_no_request(make_lora_engine):
    """Base-model and a1 rows in the same steps as the NaN adapter a2 is loaded (never requested): the
    same tokens as with a2 intact."""
    plan = {"base": "", "x": "a1", "base2": "", "y": "a1"}
    outs = []
    for poison in (False, True):
        engine = make_lora_engine(max_num_seqs=8)
        if poison:
            _poison_slot(engine, 2)  # a2: the second --lora-modules adapter
        for rid, adapter in plan.items():
            engine.add_request(rid, TEXT, sampling=greedy(8), lora_adapter=adapter)
        results = run_all(engine)
        outs.append({rid: results[rid]["tokens"] for rid in plan})
    assert outs[0] == outs[1]
    assert outs[0]["base"] != outs[0]["x"]  # the steps held adapter rows beside base-model rows
