"""Steps run through the CUDA-graph path, shapes and padding included, still equal HF.

A CPU has no CUDA graphs, so these tests swap in an emulation: `capture` records the runner's static
forward and `replay` runs it over the same static buffers. Everything a real graph depends on is then
exercised here: the padding of a step to its graph's size (one-token sequences with no slot and no
context, then empty sequences), the static input embeddings with fused image rows, and the logits rows.
tests/gpu runs the real graphs.
"""

from __future__ import annotations

import pytest

from decoder_svc.runner import model_runner
from decoder_svc.runner.cuda_graphs import GraphKey, StepGraphs, decode_sizes, mixed_sizes
from decoder_svc.runner.piecewise_graphs import live_break
from tests.engine.test_parity import ONE, START, TEXT, TWO
from tests.oracle import greedy, run_all


class EmulatedGraphs(StepGraphs):
    """StepGraphs whose replay re-runs the captured function eagerly (same buffers, same shapes); a
    piecewise graph's with every linear layer's mixing over the live step between its pieces, its output
    through the static tensor, as a replay runs it (runner/piecewise_graphs.py's live_break)."""

    replayed: list[GraphKey]

    @staticmethod
    def available(device, backend) -> bool:
        return True

    def capture(self, run, progress: bool = True, mix_out=None) -> None:
        self._run, self._mix_out, self.replayed = run, mix_out, []
        self._graphs = {key: None for key in self.keys}

    def replay(self, key: GraphKey, linear_state=None, rows: int = 0):
        self.replayed.append(key)
        if key.piecewise:
            return self._run(key, live_break(self._mix_out, linear_state, rows))
        return self._run(key)


@pytest.fixture
def graph_engine(make_engine, monkeypatch):
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    return make_engine


def test_bucket_sizes():
    assert decode_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_sizes(3) == [1, 2, 3] and decode_sizes(100)[-3:] == [80, 96, 100]
    assert mixed_sizes(2048) == [16, 32, 64, 128, 256, 512]
    assert mixed_sizes(40) == [16, 32, 64] and mixed_sizes(7) == [16]
    graphs = StepGraphs(8, 40)
    graphs._graphs = dict.fromkeys(graphs.keys)
    assert graphs.key_for(3, 3, plain_decode=True) == GraphKey(True, 4)
    assert graphs.key_for(3, 3, plain_decode=False) == GraphKey(False, 16)
    assert graphs.key_for(2, 40, plain_decode=False) == GraphKey(False, 64)
    assert graphs.key_for(9, 9, plain_decode=True) == GraphKey(False, 16)  # more sequences than decode graphs
    assert graphs.key_for(1, 64, plain_decode=False) == GraphKey(False, 64)
    assert graphs.key_for(1, 65, plain_decode=False) is None


def test_a_model_with_adapters_has_each_graph_with_and_without_the_lora_product():
    plain, with_lora = StepGraphs(8, 40), StepGraphs(8, 40, lora=True)
    assert set(with_lora.keys) == set(plain.keys) | {GraphKey(k.decode, k.size, True) for k in plain.keys}
    assert len(with_lora.keys) == 2 * len(plain.keys)
    with_lora._graphs = dict.fromkeys(with_lora.keys)
    assert with_lora.key_for(3, 3, plain_decode=True) == GraphKey(True, 4)
    assert with_lora.key_for(3, 3, plain_decode=True, lora=True) == GraphKey(True, 4, True)
    assert with_lora.key_for(2, 40, plain_decode=False, lora=True) == GraphKey(False, 64, True)
    plain._graphs = dict.fromkeys(plain.keys)
    assert plain.key_for(3, 3, plain_decode=True, lora=True) is None  # never a graph without the product


@pytest.mark.parametrize("budget", [7, 13, 100])
def test_graph_shaped_steps_equal_hf(graph_engine, hf_oracle, images, budget):
    """Mixed batches of chunks over images and decodes, each step padded to its graph's shape."""
    engine = graph_engine(max_num_batched_tokens=budget, max_num_seqs=4)
    cases = {"one": (ONE, images[:1]), "two": (TWO, images[1:3]), "text": (TEXT, []),
             "start": (START, [images[3]])}
    for rid, (prompt, imgs) in cases.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(12))
    results = run_all(engine)
    for rid, (prompt, imgs) in cases.items():
        hf_oracle.assert_same_tokens(results[rid]["tokens"], prompt, imgs, 12)
    replayed = engine.runner.graphs.replayed
    assert any(k.decode for k in replayed) and any(not k.decode for k in replayed)
    assert engine.runner.graph_steps == len(replayed)
    assert engine.stats().kv_blocks_used == 0


def test_warm_prefix_tail_runs_in_a_graph(graph_engine, hf_oracle, images):
    """An identical request computes only the tail after its cached blocks: a small mixed graph."""
    engine = graph_engine()
    engine.generate("cold", TWO, images[1:3], sampling=greedy(8))
    graphs = engine.runner.graphs
    graphs.replayed.clear()
    warm = engine.generate("warm", TWO, images[1:3], sampling=greedy(8))
    hf_oracle.assert_same_tokens(warm.new_token_ids, TWO, images[1:3], 8)
    assert warm.usage.cached_prompt_tokens > 0
    assert graphs.replayed[0] == GraphKey(False, 16) and len(graphs.replayed) == 8
