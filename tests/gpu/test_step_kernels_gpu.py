"""The kernels around a graph step, compiled: the greedy argmax (decoder_svc/runner/argmax.py) and the
embedding lookup with pending ids (decoder_svc/runner/embed_rows.py), against torch at real vocabularies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from decoder_svc.runner.argmax import argmax_rows  # noqa: E402
from decoder_svc.runner.embed_rows import embed_rows  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [32000, 151936])
@pytest.mark.parametrize("rows", [1, 32])
def test_argmax_is_torchs_gpu(dtype, vocab, rows):
    gen = torch.Generator(device="cuda").manual_seed(vocab + rows)
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * 8).to(dtype)
    logits[0, 100] = logits[0, vocab - 7] = logits[0].max() + 1  # a tie across chunks: the first
    if rows > 1:
        logits[1, [5000, 9]] = float("nan")  # NaN wins, the first one
        logits[2] = float("-inf")
    got = argmax_rows(logits)
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert got[0].item() == 100


def test_embed_rows_gpu():
    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(32000, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 32000, (24,), generator=gen, device="cuda")
    last = torch.randint(0, 32000, (16,), generator=gen, device="cuda")
    pending = (torch.tensor([0, 7, 23], device="cuda"), torch.tensor([15, 2, 0], device="cuda"))
    out = torch.empty(24, 4096, dtype=torch.bfloat16, device="cuda")
    got_ids = ids.clone()
    embed_rows(out, weight, got_ids, pending, last)
    want_ids = ids.clone()
    want_ids[pending[0]] = last[pending[1]]
    assert torch.equal(got_ids, want_ids) and torch.equal(out, weight[want_ids])
