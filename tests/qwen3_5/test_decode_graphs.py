"""The hybrid stack's decode steps through the CUDA-graph path: the state slots are a graph input buffer
(`state_slots`), pad rows continue a slot no request holds, and the tokens still equal HF's generate.

A CPU has no CUDA graphs, so the runner gets tests/engine/test_graph_shapes.py's emulation (`replay`
re-runs the captured function over the same static buffers): what a graph reads and writes is what these
steps read and write. tests/gpu runs the real graphs."""

from __future__ import annotations

import pytest

from decoder_svc.runner import model_runner
from decoder_svc.runner.inputs import ModelInput, SequenceInput
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.oracle import greedy, run_all
from tests.qwen_prompts import ONE, TEXT, TWO

N = 8


@pytest.fixture
def graph_engine(make_qwen3_5_engine, monkeypatch):
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    return make_qwen3_5_engine


def test_decode_steps_replay_graphs_and_equal_hf(graph_engine, qwen3_5_oracle, qwen_images):
    """Three requests of different lengths, graphs of 1, 2, 4 and 6 sequences: decode steps of 3 (padded
    to 4: a pad row continues the pad slot), then 2, then 1; prefill chunks (and snapshot-taking ones)
    run eagerly beside them."""
    engine = graph_engine(max_num_batched_tokens=64, max_num_seqs=6)
    runner = engine.runner
    graphs = runner.graphs
    assert graphs.mixed_sizes == [] and all(k.decode for k in graphs.keys)
    pad = runner.pad_state_slot
    assert pad == runner.linear_pool.num_slots - 1 and pad >= engine.stats().state_slots_total
    small = qwen_images[0]
    plan = {"text": (TEXT, [], N), "one": (ONE, [small], N - 3), "two": (TWO, [small, small], N + 4)}
    for rid, (prompt, imgs, n) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(n))
    results = run_all(engine)
    for rid, (prompt, imgs, n) in plan.items():
        assert results[rid]["tokens"] == qwen3_5_oracle.generate(prompt, imgs, n), rid
    sizes = {k.size for k in graphs.replayed}
    assert sizes >= {1, 2, 4} and runner.graph_steps == len(graphs.replayed)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_a_prefix_hit_resumed_from_a_snapshot_then_decoded_in_graphs(graph_engine, qwen3_5_oracle,
                                                                      qwen_images):
    """A follow-up on the same image resumes from a snapshot (its chunk eagerly), then decodes in graphs:
    the snapshot slots are untouched by the graphs' pad rows."""
    engine = graph_engine(max_num_batched_tokens=64, max_num_seqs=2)
    first = engine.generate("a", ONE, [qwen_images[0]], sampling=greedy(N))
    again = engine.generate("b", ONE, [qwen_images[0]], sampling=greedy(N))
    ref = qwen3_5_oracle.generate(ONE, [qwen_images[0]], N)
    assert first.new_token_ids == ref and again.new_token_ids == ref
    assert again.usage.cached_prompt_tokens > 0 and engine.runner.graph_steps > 0


def test_only_one_token_continuations_without_snapshots_take_a_graph(graph_engine):
    """A decode graph continues every row's slot by one token: a sequence's first token (its state must
    start from zero, not from the slot's last owner), one that takes a snapshot, or a longer chunk runs
    eagerly."""
    runner = graph_engine(max_num_seqs=4).runner

    def seq(start: int, n: int = 1, snapshots=()) -> SequenceInput:
        return SequenceInput([5] * n, start, [0], num_prompt_tokens=start + n, state_slot=0,
                             state_snapshots=list(snapshots))

    assert runner._graphable(ModelInput([seq(9), seq(4)]))
    assert not runner._graphable(ModelInput([seq(9), seq(0)]))
    assert not runner._graphable(ModelInput([seq(9), seq(4, snapshots=[(1, 3)])]))
    assert not runner._graphable(ModelInput([seq(9), seq(4, n=2)]))
