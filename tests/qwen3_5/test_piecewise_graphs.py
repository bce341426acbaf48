"""A hybrid stack's longer prefill steps through piecewise graphs (--piecewise-graphs,
runner/piecewise_graphs.py): everything but the linear layers' token mixing replays from the graph's
static buffers, and each layer's mixing runs over the live step between two pieces, its output through
one static tensor. The tokens equal HF's for prompts whose chunks are cut at snapshots, several sequences
in a step, decodes beside a prefill, and a follow-up resumed from a snapshot.

As in test_mixed_graphs.py a CPU gets tests/engine/test_graph_shapes.py's emulation (a piecewise replay
runs the static forward with runner/piecewise_graphs.py's live_break at every mixing) and the layers the
real Triton kernels in Triton's interpreter beside a torch stand-in for fla (FakeFla). tests/gpu runs the
real graphs.
"""

from __future__ import annotations

import pytest

from decoder_svc.runner.cuda_graphs import GraphKey, StepGraphs, piecewise_sizes
from tests.oracle import waves_equal_hf
from tests.qwen3_5.linear_steps import INTERPRETED, FakeFla
from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION

pytestmark = INTERPRETED


@pytest.fixture
def fake(fake_fla_graphs) -> FakeFla:
    return fake_fla_graphs


def test_sizes_and_keys():
    assert piecewise_sizes(2048) == [128, 256, 512, 1024, 2048]
    assert piecewise_sizes(100) == [128] and piecewise_sizes(300) == [128, 256, 512]
    graphs = StepGraphs(4, 300, piecewise=True)
    assert [k for k in graphs.keys if k.piecewise] == [GraphKey(False, s, piecewise=True)
                                                       for s in (128, 256, 512)]
    assert graphs.max_tokens == 512
    graphs._graphs = dict.fromkeys(graphs.keys)
    assert graphs.key_for(2, 200, False, piecewise=True) == GraphKey(False, 256, piecewise=True)
    assert graphs.key_for(2, 600, False, piecewise=True) is None
    assert not StepGraphs(4, 300).piecewise_sizes  # off unless asked for


def test_long_prefill_steps_replay_piecewise_graphs_and_equal_hf(fake, make_qwen3_5_engine, qwen3_5_oracle,
                                                                 qwen_images):
    """Text and image requests together in steps of up to 200 tokens (long chunks cut at the images'
    snapshots, two sequences in a step, decodes beside them), then a new question about a seen image
    resumed from its snapshot: tokens equal HF's generate and the first token's logprob HF's to 1e-4;
    the long steps replayed piecewise graphs, their chunked rule run between the pieces; nothing held."""
    engine = make_qwen3_5_engine(max_num_batched_tokens=200, piecewise_graphs=True)
    runner = engine.runner
    assert runner.graphs.piecewise_sizes == [128, 256]
    waves = [{"text": (TEXT, []), "one": (ONE, qwen_images[:1]), "two": (TWO, qwen_images[1:3])},
             {"follow-up": (USER + VISION + "which colours are there, one by one, left to right?" + END,
                            qwen_images[:1])}]
    results = waves_equal_hf(engine, qwen3_5_oracle, waves, 6)
    assert results["follow-up"]["usage"].cached_prompt_tokens > 0  # resumed from the image's snapshot
    replayed = runner.graphs.replayed
    assert any(k.piecewise for k in replayed) and any(k.decode for k in replayed)
    assert fake.chunk_calls  # the chunked rule ran, between pieces
    assert runner.graph_steps == len(replayed)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_without_the_flag_long_steps_run_eagerly(fake, make_qwen3_5_engine, qwen3_5_oracle, qwen_images):
    engine = make_qwen3_5_engine(max_num_batched_tokens=200)
    assert engine.runner.graphs.piecewise_sizes == []
    waves_equal_hf(engine, qwen3_5_oracle, [{"two": (TWO, qwen_images[1:3])}], 4)
    assert not any(k.piecewise for k in engine.runner.graphs.replayed)
