"""A graph step's embedding lookup (decoder_svc/runner/embed_rows.py): the Triton kernel against the
torch ops it replaces, with and without pending rows. On a CPU host the kernel runs in Triton's
interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.embed_rows import BLOCK_HIDDEN  # noqa: E402
from decoder_svc.runner.embed_rows import embed_rows, triton_embed_rows  # noqa: E402


@pytest.mark.parametrize("hidden", [64, BLOCK_HIDDEN + 40])
@pytest.mark.parametrize("with_pending", [False, True])
def test_the_kernel_writes_what_the_torch_ops_write(hidden, with_pending):
    gen = torch.Generator().manual_seed(hidden)
    weight = torch.randn(50, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 50, (9,), generator=gen)
    last = torch.randint(0, 50, (6,), generator=gen)  # the last step's samples
    # rows 2, 5 and 8 wait for samples 4, 0 and 5; a padded graph row keeps id 0
    pending = (torch.tensor([2, 5, 8]), torch.tensor([4, 0, 5])) if with_pending else None
    ids[2] = ids[5] = ids[8] = -1 if with_pending else 3
    ids[7] = 0

    want_ids, want = ids.clone(), torch.empty(9, hidden, dtype=torch.bfloat16)
    embed_rows(want, weight, want_ids, pending, last)  # the torch ops on the CPU
    got_ids, got = ids.clone(), torch.full((9, hidden), float("nan"), dtype=torch.bfloat16)
    triton_embed_rows(got, weight, got_ids, pending, last)
    assert torch.equal(got_ids, want_ids) and torch.equal(got, want)
    if with_pending:
        assert got_ids[[2, 5, 8]].tolist() == last[[4, 0, 5]].tolist()
        assert torch.equal(got[5], weight[last[0]])


def test_a_static_buffer_slice_and_bad_shapes():
    """out may be a row slice of the graphs' static embeddings; shapes that do not match are refused."""
    weight = torch.randn(10, 32)
    static = torch.zeros(8, 32)
    ids = torch.tensor([1, 2, 3])
    triton_embed_rows(static[:3], weight, ids, None, None)
    assert torch.equal(static[:3], weight[ids]) and not static[3:].any()
    with pytest.raises(ValueError, match="out must be"):
        embed_rows(static, weight, ids, None, None)
    with pytest.raises(ValueError, match="last step"):
        embed_rows(static[:3], weight, ids, (torch.tensor([0]), torch.tensor([0])), None)
