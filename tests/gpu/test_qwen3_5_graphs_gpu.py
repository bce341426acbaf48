"""Qwen3.5's hybrid stack on a CUDA device (fp32): decode steps replay real CUDA graphs whose state slots
are an input buffer, pad rows on a slot of their own; with fla (the in-place kernels) its short prefill
steps replay the mixed graphs too, each sequence token by token over its slot (model/linear_state.py's
LinearGraphRows); the tokens equal HF's generate; a follow-up resumed from a snapshot runs its new tokens
and decodes in graphs; with --piecewise-graphs its longer prefill steps replay piecewise graphs, the
linear layers' mixing (fla's chunked rule) run between the pieces. (The CPU tests run the same paths
through an emulation: tests/qwen3_5/test_decode_graphs.py, test_mixed_graphs.py, test_piecewise_graphs.py.)"""

from __future__ import annotations

from pathlib import Path

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.model.gated_deltanet_fla import load_fla
from tests.oracle import greedy, run_all
from tests.qwen_prompts import END, ONE, TEXT, TWO, USER, VISION

N = 12


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    config = EngineConfig(model=model_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                          **{"max_num_batched_tokens": 64, "max_num_seqs": 6, **overrides})
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def _record_replays(engine: LLMEngine) -> list:
    """The keys of the graphs the engine's runner replays from now on."""
    graphs, replayed = engine.runner.graphs, []
    replay = graphs.replay

    def recording(key, *live):  # (a piecewise graph's live step and rows)
        replayed.append(key)
        return replay(key, *live)

    graphs.replay = recording
    return replayed


def test_graphs_equal_hf(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    engine = _engine(qwen3_5_model_dir)
    runner = engine.runner
    fla = load_fla()[0] is not None
    assert runner.uses_cuda_graphs and runner.linear_graphs == fla
    assert runner.graphs.mixed_sizes == ([16, 32, 64] if fla else [])
    replayed = _record_replays(engine)
    small = qwen_images[0]
    plan = {"text": (TEXT, [], N), "one": (ONE, [small], N - 4), "two": (TWO, [small, small], N + 3)}
    for rid, (prompt, imgs, n) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(n))
    results = run_all(engine)
    for rid, (prompt, imgs, n) in plan.items():
        assert results[rid]["tokens"] == qwen3_5_oracle.generate(prompt, imgs, n), rid
    assert any(k.decode for k in replayed) and any(not k.decode for k in replayed) == fla
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


def test_a_snapshot_resume_then_graphs_equal_hf(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    """A new question about a seen image: resumed from the image's snapshot, its new tokens (a short
    step) in a mixed graph where fla serves, then decode graphs."""
    engine = _engine(qwen3_5_model_dir, max_num_seqs=2)
    ref = qwen3_5_oracle.generate(ONE, [qwen_images[0]], N)
    assert engine.generate("a", ONE, [qwen_images[0]], sampling=greedy(N)).new_token_ids == ref
    replayed = _record_replays(engine)
    follow_up = USER + VISION + "which colours are there?" + END
    again = engine.generate("b", follow_up, [qwen_images[0]], sampling=greedy(N))
    assert again.new_token_ids == qwen3_5_oracle.generate(follow_up, [qwen_images[0]], N)
    assert again.usage.cached_prompt_tokens > 0 and any(k.decode for k in replayed)
    assert any(not k.decode for k in replayed) == engine.runner.linear_graphs


def test_piecewise_graphs_equal_hf(qwen3_5_model_dir, qwen3_5_oracle, qwen_images):
    """Steps of up to 200 tokens (chunks cut at the images' snapshots, two sequences in a step, decodes
    beside them) in piecewise graphs of 128 and 256 rows where fla serves, then a follow-up resumed from a
    snapshot: the tokens equal HF's."""
    engine = _engine(qwen3_5_model_dir, max_num_batched_tokens=200, piecewise_graphs=True)
    fla = engine.runner.linear_graphs
    assert engine.runner.graphs.piecewise_sizes == ([128, 256] if fla else [])
    replayed = _record_replays(engine)
    plan = {"text": (TEXT, []), "one": (ONE, qwen_images[:1]), "two": (TWO, qwen_images[1:3])}
    for rid, (prompt, imgs) in plan.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == qwen3_5_oracle.generate(prompt, imgs, N), rid
    follow_up = USER + VISION + "which colours are there, one by one, left to right?" + END
    again = engine.generate("again", follow_up, qwen_images[:1], sampling=greedy(N))
    assert again.new_token_ids == qwen3_5_oracle.generate(follow_up, qwen_images[:1], N)
    assert any(k.piecewise for k in replayed) == fla
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
