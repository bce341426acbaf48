"""The runner's step buffers (decoder_svc/runner/step_buffers.py): one arena per side, a
step's inputs uploaded in one copy of the arena's prefix."""

from __future__ import annotations

import torch

from decoder_svc.runner.step_buffers import StepBuffers


def _buffers(position_rows: int = 1, groups: int = 1) -> StepBuffers:
    return StepBuffers(max_tokens=64, max_seqs=8, max_blocks=5, hidden_size=0, dtype=torch.float32,
                       device=torch.device("cpu"), position_rows=position_rows, num_groups=groups)


def test_the_buffers_are_disjoint_views_of_one_arena():
    b = _buffers(position_rows=3, groups=2)
    for i, t in enumerate(b.host.values()):
        t.fill_(i + 1)
    for i, (name, t) in enumerate(b.host.items()):  # no buffer overlaps another
        assert (t == i + 1).all(), name
    assert b.host["positions"].shape == (3, 64) and b.dev["block_tables_1"].shape == (8, 5)
    assert all(t.is_contiguous() for t in b.dev.values())
    assert (b.dev["slot_mapping"] == -1).all() and (b.dev["slot_mapping_1"] == -1).all()


def test_one_copy_brings_every_used_row_and_nothing_past_the_last():
    b = _buffers(position_rows=3)
    for t in b.host.values():
        t.copy_(torch.arange(t.numel()).view(t.shape) + 1)
    # a batch-1 decode step (M-RoPE positions: the used columns of all three rows)
    b.upload({"input_ids": 1, "positions": 1, "slot_mapping": 1, "query_start_loc": 2, "seq_lens": 1,
              "block_tables": 1, "logits_indices": 1, "pending_rows": 0, "key_limits": 0, "lora_slots": 0})
    for name in ("input_ids", "slot_mapping", "seq_lens", "logits_indices"):
        assert torch.equal(b.dev[name][:1], b.host[name][:1]), name
    assert torch.equal(b.dev["query_start_loc"][:2], b.host["query_start_loc"][:2])
    assert torch.equal(b.dev["positions"][:, :1], b.host["positions"][:, :1])
    assert torch.equal(b.dev["block_tables"][0], b.host["block_tables"][0])
    assert not b.dev["block_tables"][1:].any()  # the tables are last: past the used row, untouched

    for t in b.dev.values():
        t.zero_()
    b.upload({"lora_slots": 3})  # the buffer before the tables: the arena up to its third row
    assert torch.equal(b.dev["lora_slots"][:3], b.host["lora_slots"][:3])
    assert not b.dev["lora_slots"][3:].any() and not b.dev["block_tables"].any()
    assert torch.equal(b.dev["key_limits"], b.host["key_limits"])  # before it in the arena


def test_start_up_values_reach_both_sides():
    """Graphs are captured over device values that later uploads must not undo: set() writes both."""
    b = _buffers()
    b.set("query_start_loc", torch.arange(9, dtype=torch.int32))
    b.upload({"seq_lens": 8})  # the prefix covers query_start_loc too
    assert b.dev["query_start_loc"].tolist() == list(range(9))
