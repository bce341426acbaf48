"""Sampling features: top-k, top-p, seeds, stop strings and ids, eos, ignore_eos, max_tokens."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.engine import FinishReason, InvalidRequestError, SamplingParams
from decoder_svc.engine.request import Request
from decoder_svc.engine.sampler import Sampler, apply_top_k_top_p

PROMPT = "USER: describe the red car on the table. ASSISTANT:"


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    kept = torch.isfinite(apply_top_k_top_p(logits, 2, 0.0))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.81)).tolist() == [True, True, True, False]


def test_samples_stay_inside_top_k_and_seed_is_deterministic():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 3
    top3 = set(torch.topk(logits[0], 3).indices.tolist())

    def draw(seed: int, rid: str) -> list[int]:
        sampler = Sampler()
        req = Request(rid, [1], SamplingParams(temperature=1.5, top_k=3, seed=seed), max_tokens=1)
        return [sampler.sample(logits, [req]).token_ids[0] for _ in range(50)]

    a, b, c = draw(7, "x"), draw(7, "y"), draw(8, "x")
    assert set(a) <= top3 and len(set(a)) > 1
    assert a == b and a != c


def _greedy_reference(make_engine, n=24):
    return make_engine().generate("ref", PROMPT, sampling=SamplingParams(max_tokens=n))


def test_seeded_requests_repeat_and_differ(make_engine):
    engine = make_engine()

    def run(rid, seed):
        sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=seed)
        return engine.generate(rid, PROMPT, sampling=sp).new_token_ids

    assert run("a", 1) == run("b", 1)
    assert run("c", 1) != run("d", 2)


def test_top_k_one_and_tiny_top_p_are_greedy(make_engine):
    ref = _greedy_reference(make_engine).new_token_ids
    engine = make_engine()
    k1 = engine.generate("k1", PROMPT, sampling=SamplingParams(max_tokens=24, temperature=0.8, top_k=1))
    p0 = engine.generate("p0", PROMPT, sampling=SamplingParams(max_tokens=24, temperature=0.8, top_p=1e-6,
                                                               seed=3))
    assert k1.new_token_ids == ref and p0.new_token_ids == ref


def test_max_tokens_and_length(make_engine):
    out = make_engine().generate("m", PROMPT, sampling=SamplingParams(max_tokens=5))
    assert len(out.new_token_ids) == 5 and out.finish_reason == FinishReason.LENGTH
    assert out.usage.completion_tokens == 5


def test_default_max_tokens(make_engine):
    out = make_engine(default_max_tokens=3).generate("d", PROMPT)
    assert len(out.new_token_ids) == 3


def test_stop_token_ids(make_engine):
    ref = _greedy_reference(make_engine).new_token_ids
    stop = ref[6]
    first = ref.index(stop)
    out = make_engine().generate("s", PROMPT, sampling=SamplingParams(max_tokens=24, stop_token_ids=[stop]))
    assert out.new_token_ids == ref[:first + 1] and out.finish_reason == FinishReason.STOP


def test_eos_and_ignore_eos(make_engine):
    ref = _greedy_reference(make_engine).new_token_ids
    engine = make_engine()
    engine.eos_token_ids = frozenset({ref[4]})  # pretend this token is the model's eos
    first = ref.index(ref[4])
    out = engine.generate("e", PROMPT, sampling=SamplingParams(max_tokens=24))
    assert out.new_token_ids == ref[:first + 1] and out.finish_reason == FinishReason.STOP
    out = engine.generate("i", PROMPT, sampling=SamplingParams(max_tokens=24, ignore_eos=True))
    assert out.new_token_ids == ref and out.finish_reason == FinishReason.LENGTH


def test_stop_string_trimmed(make_engine):
    ref = _greedy_reference(make_engine)
    text = ref.text
    # A 3-character stop string starting in the middle, at its first occurrence.
    start = next(i for i in range(len(text) // 3, len(text) - 3)
                 if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    out = make_engine().generate("st", PROMPT, sampling=SamplingParams(max_tokens=24, stop=[stop]))
    assert out.finish_reason == FinishReason.STOP
    assert out.text == text[:start]
    assert out.new_token_ids == ref.new_token_ids[:len(out.new_token_ids)]
    assert len(out.new_token_ids) < 24


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=-1),
                                 dict(stop=[""]), dict(stop_token_ids=[10**6]), dict(logprobs=10**6)])
def test_invalid_sampling_rejected(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad).validate(vocab_size=512)
