"""Qwen3-VL steps with image rows replay CUDA graphs too: the DeepStack levels go through a static buffer
of the runner's (the step's image rows, zeros elsewhere) that the graph adds after the first layers.

A CPU has no CUDA graphs: tests/engine/test_graph_shapes.py's emulation replays the captured function over
the same static buffers. Served tokens equal HF's (fp32, greedy) for steps that cut through images, a
follow-up question whose uncached tail holds the image's last tokens, and text steps, which keep graphs
without the buffer. tests/gpu runs the real graphs.
"""

from __future__ import annotations

import functools

import pytest

from decoder_svc.runner import model_runner
from decoder_svc.runner.cuda_graphs import GraphKey, StepGraphs
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.oracle import greedy
from tests.qwen_prompts import END, ONE, TEXT, THREE, USER, VISION, tokens_equal_hf

N = 8
_check = functools.partial(tokens_equal_hf, n=N)


@pytest.fixture
def graph_engine(make_qwen3_engine, monkeypatch):
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    return make_qwen3_engine


def test_the_deepstack_graphs_are_the_other_steps_graphs_again():
    plain, deep = StepGraphs(8, 40), StepGraphs(8, 40, deepstack=True)
    mixed = [k for k in plain.keys if not k.decode]
    assert set(deep.keys) == set(plain.keys) | {GraphKey(False, k.size, deepstack=True) for k in mixed}
    deep._graphs = dict.fromkeys(deep.keys)
    assert deep.key_for(3, 3, plain_decode=True) == GraphKey(True, 4)
    assert deep.key_for(3, 20, plain_decode=False, deepstack=True) == GraphKey(False, 32, deepstack=True)
    plain._graphs = dict.fromkeys(plain.keys)
    assert plain.key_for(3, 20, plain_decode=False, deepstack=True) is None  # no buffer: eager


@pytest.mark.parametrize("budget", [13, 64])
def test_image_steps_replay_graphs_with_the_levels_and_equal_hf(graph_engine, qwen3_oracle, qwen_images,
                                                                budget):
    """Chunks of `budget` tokens cut through the images: every step with image rows takes a DeepStack
    graph (none runs eagerly), text-only steps the plain ones."""
    engine = graph_engine(max_num_batched_tokens=budget)
    assert engine.runner.buffers.deepstack is not None
    _check(engine, qwen3_oracle, THREE, qwen_images, rid="three")
    _check(engine, qwen3_oracle, ONE, qwen_images[:1], rid="one")
    _check(engine, qwen3_oracle, TEXT, [], rid="text")
    replayed = engine.runner.graphs.replayed
    assert any(k.deepstack for k in replayed) and any(not k.deepstack and not k.decode for k in replayed)
    assert engine.runner.graph_steps == len(replayed)  # no step ran eagerly
    assert engine.stats().kv_blocks_used == 0


def test_a_follow_up_question_s_image_tail_replays_a_graph(graph_engine, qwen3_oracle, qwen_images):
    """A new question about the same image: the cached prefix ends inside the image, and the step that
    computes the rest (the image's last rows, with their levels, and the question) is one graph."""
    engine = graph_engine(max_num_batched_tokens=512)
    _check(engine, qwen3_oracle, ONE, qwen_images[:1], rid="cold")
    graphs = engine.runner.graphs
    graphs.replayed.clear()
    follow_up = USER + VISION + "which colours does it have, one by one?" + END
    out = _check(engine, qwen3_oracle, follow_up, qwen_images[:1], rid="follow-up")
    assert out.usage.cached_prompt_tokens > 0 and out.usage.images_skipped_by_kv_reuse == 0
    assert graphs.replayed[0].deepstack and len(graphs.replayed) == N


def test_the_level_buffer_is_cleared_between_image_steps(graph_engine, qwen3_oracle, qwen_images):
    """Two image requests one after the other in one engine, the second's image rows at other positions
    than the first's: stale levels left in the buffer would change the second's tokens."""
    engine = graph_engine(max_num_batched_tokens=512)
    engine.generate("first", THREE, qwen_images, sampling=greedy(2))
    _check(engine, qwen3_oracle, ONE, qwen_images[1:2], rid="second")
    assert any(k.deepstack for k in engine.runner.graphs.replayed)
