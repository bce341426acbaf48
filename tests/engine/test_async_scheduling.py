"""Asynchronous scheduling: step N+1 is launched before step N's tokens are read, its pending tokens taken
from N's output on the device. Every test of this folder that uses `make_engine` already runs both ways
(HF parity included); these check what only the asynchronous engine does."""

from __future__ import annotations

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.request import FinishReason
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.runner.inputs import PENDING_TOKEN
from tests.oracle import greedy

ASYNC = pytest.mark.parametrize("make_engine", ["on"], indirect=True)  # asynchronous unless told

ONE = "USER: <image>\nWhat is shown in this picture? ASSISTANT:"
TEXT = "USER: describe the red car on the table. ASSISTANT:"


def _run(engine: LLMEngine, requests: dict[str, tuple], steps: list | None = None) -> dict[str, list]:
    """Add every request, step until nothing is left; each request's outputs, in order."""
    for rid, (prompt, imgs, sampling) in requests.items():
        engine.add_request(rid, prompt, imgs, sampling=sampling)
    results: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].append(out)
        if steps is not None:
            steps.append(engine.stats())
    return results


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@ASYNC
def test_pending_tokens_are_taken_from_the_device(make_engine, hf_oracle, images, monkeypatch):
    engine = make_engine(async_scheduling="on", max_num_batched_tokens=24)
    pending = []
    launch = engine.runner.launch

    def spy(batch):
        pending.append(sum(s.token_ids[-1] == PENDING_TOKEN for s in batch.sequences))
        assert all(PENDING_TOKEN not in s.token_ids[:-1] for s in batch.sequences)
        return launch(batch)

    monkeypatch.setattr(engine.runner, "launch", spy)
    results = _run(engine, {"a": (ONE, images[:1], greedy(12)), "b": (TEXT, [], greedy(12))})
    # Every decode step after the first token computes the token the step before sampled.
    assert sum(pending) >= 2 * 10
    hf_oracle.assert_same_tokens(_tokens(results["a"]), ONE, images[:1], 12)
    hf_oracle.assert_same_tokens(_tokens(results["b"]), TEXT, [], 12)


@ASYNC
def test_same_outputs_both_ways_with_stops_seeds_and_logprobs(make_engine, images):
    """A stop token, a stop string, a seeded sampler, logprobs and min_tokens: each request's tokens,
    text, logprobs and finish reason are the same whether the next step is launched first or not."""
    sync = make_engine(async_scheduling="off", num_kv_blocks=12, max_num_batched_tokens=20, max_num_seqs=3)
    first = sync.generate("probe", TEXT, sampling=greedy(6)).new_token_ids
    requests = {
        "stop-token": (TEXT, [], SamplingParams(max_tokens=12, stop_token_ids=[first[2]])),
        "stop-string": (ONE, images[:1], SamplingParams(max_tokens=12, stop=[" "])),
        "seeded": (ONE, images[1:2], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7)),
        "logprobs": (TEXT, [], SamplingParams(max_tokens=7, logprobs=3)),
        "min-tokens": (TEXT, [], SamplingParams(max_tokens=9, min_tokens=4, stop_token_ids=[first[0]])),
    }
    got = {}
    for mode in ("off", "on"):
        engine = make_engine(async_scheduling=mode, num_kv_blocks=12, max_num_batched_tokens=20,
                             max_num_seqs=3)  # a small pool: preemptions while steps are in flight
        results = _run(engine, requests)
        got[mode] = {rid: (_tokens(o), "".join(x.text for x in o), [x.logprobs for x in o],
                           o[-1].finish_reason) for rid, o in results.items()}
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and engine.scheduler.images.num_held == 0
        assert engine.outputs.num_followed == 0 and not engine.scheduler.requests
    assert got["on"] == got["off"]
    assert got["on"]["stop-token"][3] == FinishReason.STOP and len(got["on"]["stop-token"][0]) == 3


@ASYNC
def test_a_request_ended_while_its_next_step_runs(make_engine):
    """Aborted between launching a step that computes its token and reading it: the token is dropped,
    its blocks freed, the others go on."""
    engine = make_engine(async_scheduling="on")
    engine.add_request("a", TEXT, sampling=greedy(8))
    engine.add_request("b", TEXT, sampling=greedy(8))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.get("a").num_pending_outputs == 1
    engine.abort("a")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    a = [o for o in outs if o.request_id == "a"]
    assert [o.finish_reason for o in a] == [FinishReason.ABORT] and not a[0].new_token_ids
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "b") == 8 - 2
    assert engine.stats().kv_blocks_used == 0


@ASYNC
def test_no_step_past_a_length_limit(make_engine, tiny_model_dir):
    """A request whose pending token reaches max_tokens or the model's length is not scheduled again
    (a step past max_model_len would have no KV slot)."""
    engine = make_engine(async_scheduling="on")
    max_len = engine.model_config.max_model_len
    prompt_ids = [5 + i % 300 for i in range(max_len - 3)]  # text ids of the tiny vocabulary
    engine.add_request("long", prompt_token_ids=prompt_ids, sampling=SamplingParams(max_tokens=3))
    engine.add_request("short", TEXT, sampling=greedy(1))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        for req in engine.scheduler.running:
            assert req.num_computed_tokens <= max_len
    long = [o for o in outs if o.request_id == "long"]
    assert len(_tokens(long)) == 3 and long[-1].finish_reason == FinishReason.LENGTH
    assert engine.stats().kv_blocks_used == 0


def test_async_scheduling_on_is_refused_with_tensor_parallelism(tiny_model_dir):
    config = EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, async_scheduling="on")
    with pytest.raises(ValueError, match="async-scheduling on needs --tensor-parallel-size 1"):
        LLMEngine(config, embedding_source=None)
