"""n samples of one prompt against n separately seeded requests, on any family's tiny checkpoint (the
families' tests of engine/fanout.py)."""

from __future__ import annotations

from pathlib import Path

from decoder_svc.engine import EngineConfig, LLMEngine, SamplingParams
from decoder_svc.engine.fanout import child_seed
from decoder_svc.engine.local_source import LocalEmbeddingSource


def fanout_engine(model_dir: Path, **overrides) -> LLMEngine:
    """An in-process engine on the checkpoint (fp32, CPU, its own vision tower)."""
    cfg = dict(model=model_dir, num_kv_blocks=256, max_num_batched_tokens=2048, block_size=16)
    cfg.update(overrides)
    config = EngineConfig(**cfg)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


def run_choices(engine: LLMEngine) -> dict[tuple[str, int], list[int]]:
    """Step until idle; each (request id, choice index)'s tokens."""
    tokens: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return tokens


def check_samples_match_seeded_requests(model_dir: Path, prompt: str, images: list, n: int = 3,
                                         **overrides) -> None:
    """n samples of one prefill (engine/fanout.py) against n requests seeded seed + i: the same tokens
    per choice, n - 1 forked, nothing held after."""
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    separate = fanout_engine(model_dir, **overrides)
    for i in range(n):
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=child_seed(11, i), ignore_eos=True)
        separate.add_request(f"s{i}", prompt, images, sampling=params)
    expected = run_choices(separate)
    engine = fanout_engine(model_dir, **overrides)
    engine.add_request("p", prompt, images, sampling=sampling, n=n)
    got = run_choices(engine)
    assert [got[("p", i)] for i in range(n)] == [expected[(f"s{i}", 0)] for i in range(n)]
    s = engine.stats()
    assert s.samples_forked == n - 1 and s.kv_blocks_used == 0 and s.running == 0
    assert all(b.ref_cnt == 0 for b in engine.blocks.blocks) and not engine.scheduler.requests
