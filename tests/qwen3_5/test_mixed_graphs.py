"""A hybrid stack's small steps beyond plain decode through the CUDA-graph path (runner/model_runner.py,
model/linear_state.py's LinearGraphRows): where its linear layers have the in-place kernels, a step whose
sequences are all short and take no snapshot (a short prompt's chunk, a warm request's new tokens, a first
token, decodes beside them) replays a mixed graph in which every sequence runs token by token from its slot
(a zero state where it starts), pad sequences on a slot of their own; the tokens still equal HF's.

As in test_decode_graphs.py a CPU gets tests/engine/test_graph_shapes.py's emulation (`replay` re-runs the
captured function over the same static buffers), and the layers get the real Triton kernels in Triton's
interpreter beside a torch stand-in for fla (tests/qwen3_5/linear_steps.py's FakeFla). tests/gpu runs the
real graphs."""

from __future__ import annotations

import numpy as np
import pytest

from decoder_svc.model.linear_state import SHORT_PIECE, conv_source_codes, stage_graph_rows
from decoder_svc.runner import model_runner
from decoder_svc.runner.inputs import ModelInput, SequenceInput
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.qwen3_5.linear_steps import INTERPRETED, FakeFla

pytestmark = INTERPRETED


@pytest.fixture
def fake(fake_fla_graphs) -> FakeFla:
    return fake_fla_graphs


def test_short_steps_replay_mixed_graphs_and_equal_hf(fake, make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    """Concurrent text and image requests in 24-token chunks (chunks cut images; fresh and resumed
    sequences, decodes beside them, in graphs of 16 and 32 rows padded with pad sequences), then a new
    question about a seen image resumed from its snapshot, then a fresh request in a slot another one
    left (its state must start from zeros): tokens equal HF's generate and the first
    token's logprob HF's to 1e-4; no slot or block left held."""
    from tests.oracle import waves_equal_hf
    from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION

    engine = make_qwen3_5_engine(max_num_batched_tokens=24)
    runner = engine.runner
    assert runner.linear_graphs and runner.graphs.mixed_sizes == [16, 32]
    waves = [{"text": (TEXT, []), "one": (ONE, qwen_images[:1]), "two": (TWO, [qwen_images[0]] * 2)},
             {"warm": (USER + VISION + "which colours are there?" + END, qwen_images[:1])},
             # a slot another one left; its first chunk takes no snapshot (its prompt's last block boundary
             # lies beyond it), so it runs in a graph, from a zero state
             {"fresh": (USER + "describe a blue boat on the sea, the gulls above it, the harbour behind it "
                        "and the evening light over the water" + END, [])}]
    results = waves_equal_hf(engine, qwen3_5_oracle, waves, 6)
    assert results["warm"]["usage"].cached_prompt_tokens > 0  # resumed from the image's snapshot
    fresh = results["fresh"]["usage"]
    assert fresh.cached_prompt_tokens == 0 and fresh.prompt_tokens > 32
    mixed = [k for k in runner.graphs.replayed if not k.decode]
    assert {k.size for k in mixed} == {16, 32} and any(k.decode for k in runner.graphs.replayed)
    # every prefill chunk ran in a graph but the snapshot-taking ones (each image's end, eagerly)
    assert fake.chunk_calls == [] and fake.recurrent_calls == []
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_which_hybrid_steps_take_a_mixed_graph(fake, make_qwen3_5_engine):
    runner = make_qwen3_5_engine(max_num_seqs=4).runner

    def seq(start: int, n: int = 1, snapshots=()) -> SequenceInput:
        return SequenceInput([5] * n, start, [0], num_prompt_tokens=start + n, state_slot=0,
                             state_snapshots=list(snapshots))

    assert runner._decode_graphable(ModelInput([seq(9), seq(4)]))
    first_token = ModelInput([seq(9), seq(0)])  # a zero state: a mixed graph, not a decode one
    assert runner._graphable(first_token) and not runner._decode_graphable(first_token)
    assert runner._graphable(ModelInput([seq(9), seq(4, n=SHORT_PIECE)]))
    assert runner._graphable(ModelInput([seq(9), seq(4, n=20, snapshots=[(12, 3)])]))
    assert not runner._graphable(ModelInput([seq(9), seq(4, n=SHORT_PIECE + 1)]))
    assert not runner._graphable(ModelInput([seq(9), seq(4, n=20, snapshots=[(4, 3), (12, 2)])]))


def test_without_the_in_place_kernels_only_decode_steps_have_graphs(make_qwen3_5_engine, monkeypatch):
    """The torch reference (or fla without the in-place kernels) cannot run a graph's rows."""
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    monkeypatch.setattr("decoder_svc.model.gated_deltanet.kernels_for",
                        lambda device: FakeFla(in_place=False).kernels())
    runner = make_qwen3_5_engine(max_num_seqs=4).runner
    assert not runner.linear_graphs and runner.graphs.mixed_sizes == []


def test_staged_rows_name_each_sequence_s_inputs_and_pad_the_rest():
    """Two sequences (a resumed one in slot 3 taking a snapshot into slot 6 after its 2nd token, a fresh
    one in slot 1) in a graph of 8 rows and 6 sequences: their codes as conv_source_codes makes them, then
    pads (fresh, the pad slot, zero inputs, no snapshot)."""
    taps, pad = 4, 9
    out = {"slots": np.zeros(8, np.int64), "fresh": np.zeros(8, np.int32),
           "snapshot_rows": np.zeros(8, np.int32), "snapshot_slots": np.zeros(8, np.int64),
           "window_slots": np.zeros(16, np.int64), "window_codes": np.zeros((16, taps - 1), np.int32),
           "conv_codes": np.zeros((8, taps), np.int32)}
    stage_graph_rows([(0, 3, 10, 3, ((2, 6),)), (3, 2, 0, 1, ())], 6, pad, out)
    assert out["slots"][:6].tolist() == [3, 1, pad, pad, pad, pad]
    assert out["fresh"][:6].tolist() == [0, 1, 1, 1, 1, 1]
    assert out["snapshot_rows"][:6].tolist() == [1, -1, -1, -1, -1, -1]
    assert out["snapshot_slots"][:6].tolist() == [6] + [pad] * 5
    assert out["window_slots"][:12].tolist() == [3, 1] + [pad] * 4 + [6] + [pad] * 5
    resumed, resumed_windows = conv_source_codes(0, 3, 3, False, [3, 2], taps)
    assert out["conv_codes"][:3].tolist() == resumed.tolist()
    assert out["window_codes"][0].tolist() == resumed_windows[0].tolist()
    assert out["window_codes"][6].tolist() == resumed_windows[1].tolist() == [-(3 * 3 + 2) - 2, 0, 1]
    # the resumed one's first row reads its slot's three carried columns, oldest first, then itself
    assert out["conv_codes"][0].tolist() == [-(3 * 3 + 0) - 2, -(3 * 3 + 1) - 2, -(3 * 3 + 2) - 2, 0]
    assert out["conv_codes"][3].tolist() == [-1, -1, -1, 3]  # fresh: zeros before its first row
    assert out["window_codes"][1].tolist() == [-1, 3, 4]
    assert (out["conv_codes"][5:] == -1).all() and (out["window_codes"][2:6] == -1).all()
    assert (out["window_codes"][7:12] == -1).all()
    with pytest.raises(ValueError, match="one snapshot"):
        stage_graph_rows([(0, 3, 10, 3, ((1, 5), (2, 6)))], 6, pad, out)
