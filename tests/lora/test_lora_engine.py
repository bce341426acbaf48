"""Adapters served per request: greedy tokens under an adapter equal HF's model on the checkpoint with
that adapter merged into its weights (fp32), alone or in batches that mix adapters, whatever the chunk
size, through preemption; prefix KV is reused only under the same adapter."""

from __future__ import annotations

import pytest

from decoder_svc.engine.sampling_params import InvalidRequestError
from tests.oracle import greedy, make_image, run_all

N = 12
TEXT = "USER: describe the red car on the table. ASSISTANT:"
LONG = "USER: " + "the quick brown fox jumps over the lazy dog " * 4 + "ASSISTANT:"
MID = "USER: the quick brown fox jumps over the lazy dog, twice. ASSISTANT:"
ONE = "USER: <image>\nWhat is shown in this picture? ASSISTANT:"


@pytest.mark.parametrize("adapter", ["", "a1", "a2"])
def test_adapter_equals_merged_weights(make_lora_engine, merged_oracles, adapter):
    engine = make_lora_engine()
    out = engine.generate("r", TEXT, sampling=greedy(N), lora_adapter=adapter)
    merged_oracles[adapter].assert_same_tokens(out.new_token_ids, TEXT, [], N)


def test_adapters_change_the_output(make_lora_engine):
    """The adapters are large enough to matter: each gives other tokens than the base and each other
    (so a row run under the wrong slot would fail the reference tests)."""
    engine = make_lora_engine()
    outs = {a: engine.generate(f"r{a}", TEXT, sampling=greedy(N), lora_adapter=a).new_token_ids
            for a in ("", "a1", "a2")}
    assert len({tuple(t) for t in outs.values()}) == 3


def test_steps_without_adapters_run_no_lora_product(make_lora_engine, merged_oracles, monkeypatch):
    """A step whose rows all run the base model binds no slots (its graphs are the ones without the LoRA
    kernels, and the one-row fused products serve it); a step with an adapter row runs the product."""
    from decoder_svc.model.ops import TorchOps

    engine = make_lora_engine()
    calls: list[int] = []
    real = TorchOps.lora_add

    def counted(y, x, lora_a, lora_b, slots, rank):
        calls.append(x.shape[0])
        return real(y, x, lora_a, lora_b, slots, rank)

    monkeypatch.setattr(engine.model.ops, "lora_add", staticmethod(counted))
    out = engine.generate("base", TEXT, sampling=greedy(N))
    merged_oracles[""].assert_same_tokens(out.new_token_ids, TEXT, [], N)
    assert calls == [] and not engine.model.lora.active
    out = engine.generate("a1", TEXT, sampling=greedy(N), lora_adapter="a1")
    merged_oracles["a1"].assert_same_tokens(out.new_token_ids, TEXT, [], N)
    assert calls


@pytest.mark.parametrize("budget", [7, 13, 2048])
def test_mixed_batch_any_chunk_size(make_lora_engine, merged_oracles, budget):
    """Base and both adapters in the same steps, prompts split into chunks at odd places."""
    engine = make_lora_engine(max_num_batched_tokens=budget)
    plan = {"b": ("", TEXT), "x": ("a1", TEXT), "y": ("a2", TEXT), "z": ("a1", LONG), "w": ("", LONG)}
    for rid, (adapter, prompt) in plan.items():
        engine.add_request(rid, prompt, sampling=greedy(N), lora_adapter=adapter)
    results = run_all(engine)
    for rid, (adapter, prompt) in plan.items():
        merged_oracles[adapter].assert_same_tokens(results[rid]["tokens"], prompt, [], N)
    assert engine.stats().kv_blocks_used == 0


def test_image_request_under_an_adapter(make_lora_engine, merged_oracles):
    """The adapter applies to every row, image tokens' too, as merged weights do."""
    engine = make_lora_engine(max_num_batched_tokens=13)
    image = [make_image(1, (40, 52))]
    out = engine.generate("img", ONE, image, sampling=greedy(N), lora_adapter="a2")
    merged_oracles["a2"].assert_same_tokens(out.new_token_ids, ONE, image, N)


def test_preemption_keeps_each_adapter(make_lora_engine, merged_oracles):
    engine = make_lora_engine(num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    plan = {"a": ("a1", MID), "b": ("a2", TEXT), "c": ("", TEXT), "d": ("a1", TEXT)}
    for rid, (adapter, prompt) in plan.items():
        engine.add_request(rid, prompt, sampling=greedy(20), lora_adapter=adapter)
    results = run_all(engine)
    assert engine.stats().preemptions > 0
    for rid, (adapter, prompt) in plan.items():
        merged_oracles[adapter].assert_same_tokens(results[rid]["tokens"], prompt, [], 20)


def test_prefix_cache_is_keyed_by_adapter(make_lora_engine, merged_oracles):
    """An identical prompt under another adapter (or none) reuses no KV; under the same adapter it does;
    the stats count hits per adapter."""
    engine = make_lora_engine()
    first = engine.generate("first", LONG, sampling=greedy(N), lora_adapter="a1")
    other = engine.generate("other", LONG, sampling=greedy(N), lora_adapter="a2")
    base = engine.generate("base", LONG, sampling=greedy(N))
    same = engine.generate("same", LONG, sampling=greedy(N), lora_adapter="a1")
    assert first.usage.cached_prompt_tokens == 0
    assert other.usage.cached_prompt_tokens == 0
    assert base.usage.cached_prompt_tokens == 0
    n_prompt = same.usage.prompt_tokens
    assert same.usage.cached_prompt_tokens == (n_prompt - 1) // 16 * 16 > 0
    for adapter, out in (("a2", other), ("", base), ("a1", same)):
        merged_oracles[adapter].assert_same_tokens(out.new_token_ids, LONG, [], N)
    assert engine.stats().prefix_cache_hit_tokens_by_adapter == {
        "a1": same.usage.cached_prompt_tokens, "a2": 0, "": 0}
    engine.reset_stats()
    assert engine.stats().prefix_cache_hit_tokens_by_adapter == {}


def test_unknown_adapter_is_refused(make_lora_engine):
    engine = make_lora_engine()
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("bad", TEXT, sampling=greedy(N), lora_adapter="nope")
    assert engine.generate("good", TEXT, sampling=greedy(2), lora_adapter="a1").new_token_ids


def test_a_huge_unknown_adapter_name_is_echoed_cut(make_lora_engine):
    engine = make_lora_engine()
    with pytest.raises(InvalidRequestError) as err:  # whole, it would be over gRPC's metadata limit
        engine.add_request("huge", TEXT, sampling=greedy(N), lora_adapter="x" * 2**20)
    message = str(err.value)
    assert len(message) < 300 and "1048576 characters" in message and "'a1'" in message
