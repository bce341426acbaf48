"""The deterministic mode on Qwen3.5's hybrid stack (its Gated DeltaNet layers run token by token in the
recurrent form: model/gated_deltanet.py `_token_by_token`): the reference request's tokens and logprobs are
the same bits alone, among 7 others, chunked by 13 and after a prefix hit resumed from a state snapshot;
its greedy tokens are still HF's."""

from __future__ import annotations

import pytest

from decoder_svc.engine import SamplingParams
from decoder_svc.runner import model_runner
from tests.deterministic_runs import QWEN_PROMPTS, deterministic_engine, pictures, reference_run
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.qwen_prompts import ONE, TEXT, tokens_equal_hf

N = 6


def params() -> SamplingParams:
    return SamplingParams(max_tokens=N, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def images() -> list:
    return pictures()


@pytest.fixture(scope="module")
def alone(qwen3_5_model_dir, images) -> tuple[list, list]:
    out = reference_run(deterministic_engine(qwen3_5_model_dir), images, QWEN_PROMPTS, params=params())
    assert len(out[0]) == len(out[1]) == N
    return out


def test_among_seven_others_same_bits(qwen3_5_model_dir, images, alone):
    engine = deterministic_engine(qwen3_5_model_dir)
    assert reference_run(engine, images, QWEN_PROMPTS, company=7, params=params()) == alone


def test_among_seven_others_in_decode_graphs_same_bits(qwen3_5_model_dir, images, alone, monkeypatch):
    """Decode steps replayed from graphs (tests/engine/test_graph_shapes.py's emulation on a CPU): the rows
    padded to a graph's size, one row at a time over the static buffers."""
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    engine = deterministic_engine(qwen3_5_model_dir)
    assert reference_run(engine, images, QWEN_PROMPTS, company=7, params=params()) == alone
    assert len({k.size for k in engine.runner.graphs.replayed}) > 1


def test_chunked_by_13_same_bits(qwen3_5_model_dir, images, alone):
    engine = deterministic_engine(qwen3_5_model_dir, max_num_batched_tokens=13)
    assert reference_run(engine, images, QWEN_PROMPTS, params=params()) == alone


def test_after_a_prefix_hit_same_bits(qwen3_5_model_dir, images, alone):
    """The same request again resumes from the snapshot at its last block boundary, then prefills the
    rest, in chunks of 13 as the first one was. (Unchunked, a resumed prompt is cut where the cold one was
    cut for its snapshots: the same pieces whatever the mode.)"""
    engine = deterministic_engine(qwen3_5_model_dir, max_num_batched_tokens=13)
    assert reference_run(engine, images, QWEN_PROMPTS, warm=True, params=params()) == alone
    assert engine.stats().state_snapshot_hits == 1


def test_greedy_tokens_equal_hf(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    engine = deterministic_engine(qwen3_5_model_dir, max_num_batched_tokens=13)
    tokens_equal_hf(engine, qwen3_5_oracle, ONE, qwen_images[:1], "image", n=N)
    tokens_equal_hf(engine, qwen3_5_oracle, TEXT, [], "text", n=N)
