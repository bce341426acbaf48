"""The deterministic mode on Qwen3.5's hybrid stack (its Gated DeltaNet layers run token by token in the
recurrent form: model/gated_deltanet.py `_token_by_token`): one layer gives a sequence's rows, state and
snapshots the same bits whole or in pieces among other sequences; the engine gives the reference request's
tokens and logprobs the same bits alone, among 7 others (decode graphs too), chunked by 13 and after a
prefix hit resumed from a state snapshot; its greedy tokens are still HF's."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.engine import SamplingParams
from decoder_svc.model.batch_invariant import BatchInvariantMatmuls
from decoder_svc.runner import model_runner
from tests.deterministic_runs import QWEN_PROMPTS, deterministic_engine, pictures, reference_run
from tests.engine.test_graph_shapes import EmulatedGraphs
from tests.qwen3_5.linear_steps import (
    LAYER,
    build_step,
    clone_pool,
    noisy_pool,
    random_layer,
    rows_input,
    text_shape,
)
from tests.qwen_prompts import ONE, TEXT, tokens_equal_hf

N = 6


def params() -> SamplingParams:
    return SamplingParams(max_tokens=N, logprobs=3, ignore_eos=True)


# The reference sequence's 40 tokens in slot 0 (snapshots into 6 and 7 after 3 and 17 tokens), whole or
# in four steps beside other sequences: a fresh chunk after another one, a resumed chunk, a decode row
# among another, a chunk after a decode row. (tokens, start, slot, snapshots) as linear_steps.LAYOUTS.
WHOLE = [[(40, 0, 0, ((3, 6), (17, 7)))]]
PIECES = [[(5, 0, 1, ()), (3, 0, 0, ((3, 6),))], [(14, 3, 0, ((14, 7),))],
          [(1, 9, 2, ()), (1, 17, 0, ())], [(1, 10, 2, ()), (22, 18, 0, ())]]


@torch.no_grad()
def _stepped(layer, pool, steps: list[list[tuple]], x: torch.Tensor) -> torch.Tensor:
    """Slot 0's sequence's output rows over `steps` (other sequences' rows: noise)."""
    out, done = [], 0
    for i, layout in enumerate(steps):
        step, rows = build_step(pool, layout)
        inputs = rows_input(rows, x.shape[1], seed=10 + i)
        first = 0
        for n, _, slot, _ in layout:
            if slot == 0:
                break
            first += n
        inputs[first:first + n] = x[done:done + n]
        with BatchInvariantMatmuls():
            out.append(layer.forward_batch(inputs, step, LAYER)[first:first + n])
        done += n
    return torch.cat(out)


def test_a_layer_gives_a_sequence_the_same_bits_whole_or_in_pieces_among_others():
    shape = text_shape()
    layer, whole_pool = random_layer(shape), noisy_pool(shape)
    pieces_pool = clone_pool(whole_pool)
    x = rows_input(40, shape.hidden_size)
    assert torch.equal(_stepped(layer, pieces_pool, PIECES, x), _stepped(layer, whole_pool, WHOLE, x))
    for slot in (0, 6, 7):
        assert torch.equal(pieces_pool.conv[LAYER][slot], whole_pool.conv[LAYER][slot]), slot
        assert torch.equal(pieces_pool.recurrent[LAYER][slot], whole_pool.recurrent[LAYER][slot]), slot


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
