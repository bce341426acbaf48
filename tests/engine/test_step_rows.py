"""A step's image rows packed into one byte tensor for the tensor-parallel broadcast come back equal:
every dtype and shape (multi-part Qwen3-VL rows too), views that are not contiguous, odd byte counts,
sequences without images; a step without image rows is sent as it is."""

from __future__ import annotations

import torch

from decoder_svc.runner.inputs import ModelInput, SequenceInput
from decoder_svc.runner.step_rows import join_rows, split_rows


def _seq(rows: list[torch.Tensor]) -> SequenceInput:
    return SequenceInput([1, 2, 3], 0, [0], 3, rows)


def test_rows_round_trip_through_the_packed_tensor():
    torch.manual_seed(0)
    wide = torch.randn(5, 12)
    rows = [[torch.randn(3, 8).to(torch.bfloat16), wide[:, ::2]],  # a strided view
            [],
            [torch.randn(4, 2, 7), torch.randn(1, 3, dtype=torch.float16)]]  # [parts, rows, hidden], 6 bytes
    batch = ModelInput([_seq(r) for r in rows], finished_request_ids=["gone"])
    plain, layout, packed = split_rows(batch)
    assert all(not s.image_rows for s in plain.sequences) and plain.finished_request_ids == ["gone"]
    assert packed.dtype == torch.uint8 and packed.numel() == layout.nbytes
    assert all(p.offset % 16 == 0 for pieces in layout.pieces for p in pieces)
    back = join_rows(plain, layout, packed.clone())
    for before, after in zip(batch.sequences, back.sequences, strict=True):
        assert after.token_ids == before.token_ids and after.block_table == before.block_table
        assert len(after.image_rows) == len(before.image_rows)
        for a, b in zip(after.image_rows, before.image_rows, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_step_without_image_rows_is_sent_as_it_is():
    batch = ModelInput([_seq([]), _seq([])])
    plain, layout, packed = split_rows(batch)
    assert plain is batch and layout is None and packed is None
