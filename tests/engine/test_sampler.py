"""Sampling features: top-k, top-p, seeds, stop strings and ids, eos, ignore_eos, max_tokens."""

from __future__ import annotations

import pytest
import torch

from decoder_svc.engine import FinishReason, InvalidRequestError, SamplingParams
from decoder_svc.runner.sampler import Sampler, SamplingRow, apply_top_k_top_p

PROMPT = "USER: describe the red car on the table. ASSISTANT:"


def _mask(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """apply_top_k_top_p on a [B, V] batch (a 1-D logits vector is a 1-row batch); the kept positions."""
    batch = logits if logits.dim() == 2 else logits.unsqueeze(0)
    out = apply_top_k_top_p(batch, torch.tensor(top_k), torch.tensor(top_p))
    kept = torch.isfinite(out)
    return kept if logits.dim() == 2 else kept[0]


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    assert _mask(logits, [2], [0.0]).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert _mask(logits, [0], [0.7]).tolist() == [True, True, False, False]
    assert _mask(logits, [0], [0.5]).tolist() == [True, False, False, False]
    assert _mask(logits, [0], [0.81]).tolist() == [True, True, True, False]


def test_top_k_top_p_rows_use_their_own_values():
    # Each row holds the same distribution, with its tokens in a different order.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perms = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2], [0, 2, 1, 3], [3, 0, 2, 1]]
    logits = torch.stack([probs.log()[torch.argsort(torch.tensor(p))] for p in perms])
    # off, top-k 2, top-p 0.7, top-k 3 + top-p 0.81 (nucleus on the renormalised top 3: .53, .32, .16),
    # top-k 2 + top-p 0.6 (renormalised top 2: .625 alone reaches it), top-p 1 and top-k >= V (both off).
    top_k, top_p = [0, 2, 0, 3, 2, 4], [0.0, 0.0, 0.7, 0.81, 0.6, 1.0]
    kept_by_rank = [[True] * 4, [True, True, False, False], [True, True, False, False],
                    [True, True, False, False], [True, False, False, False], [True] * 4]
    kept = _mask(logits, top_k, top_p)
    for row, perm in enumerate(perms):
        # perm[r] is the position of the token of rank r in this row.
        assert [bool(kept[row, perm[r]]) for r in range(4)] == kept_by_rank[row], row


def _row(rid: str, **params) -> SamplingRow:
    return SamplingRow(rid, SamplingParams(**params))


def test_samples_stay_inside_top_k_and_seed_is_deterministic():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 3
    top3 = set(torch.topk(logits[0], 3).indices.tolist())

    def draw(seed: int, rid: str) -> list[int]:
        sampler = Sampler("cpu")
        row = _row(rid, temperature=1.5, top_k=3, seed=seed)
        return [sampler.sample(logits, [row]).token_ids[0] for _ in range(50)]

    a, b, c = draw(7, "x"), draw(7, "y"), draw(8, "x")
    assert set(a) <= top3 and len(set(a)) > 1
    assert a == b and a != c


def test_seeded_row_independent_of_batch_company_and_position():
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(64, generator=gen) * 2
    others = torch.randn(3, 64, generator=gen) * 2
    params = dict(temperature=1.2, top_p=0.95, top_k=20, seed=11)

    alone, batched = Sampler("cpu"), Sampler("cpu")
    solo_tokens, batch_tokens = [], []
    for _ in range(30):
        solo_tokens.append(alone.sample(target.unsqueeze(0), [_row("s", **params)]).token_ids[0])
        rows = [_row("u", temperature=1.0), _row("t", temperature=0.7, seed=11), _row("g"),
                _row("s", **params)]
        batch_tokens.append(batched.sample(torch.cat([others, target.unsqueeze(0)]), rows).token_ids[3])
    assert solo_tokens == batch_tokens and len(set(solo_tokens)) > 1
    # forget drops the generator: the sequence starts over from the seed.
    alone.forget("s")
    assert alone.sample(target.unsqueeze(0), [_row("s", **params)]).token_ids[0] == solo_tokens[0]


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2)) * 4
    rows = [_row("a"), _row("b", temperature=1.0), _row("c", temperature=0.8, top_k=1),
            _row("d", temperature=1.0, top_p=0.9, seed=5), _row("e", temperature=0.0, top_p=0.5),
            _row("f", temperature=2.0, top_k=10)]
    out = Sampler("cpu").sample(logits, rows).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert all(0 <= t < 100 for t in out)


def test_degenerate_temperatures_and_logits_give_valid_ids():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(3))
    logits[4, 7] = float("nan")  # a NaN logit: the row's softmax is NaN
    logits[5] = float("nan")  # a whole NaN row
    logits[6, 9] = float("inf")
    rows = [_row("nan", temperature=float("nan")), _row("tiny", temperature=1e-45),
            _row("inf", temperature=float("inf"), seed=1), _row("ok", temperature=1.0, top_p=0.9),
            _row("nanlogit", temperature=1.0), _row("nanrow", temperature=1.0, top_k=5),
            _row("inflogit", temperature=0.5, seed=2)]
    out = Sampler("cpu").sample(logits, rows).token_ids
    assert all(isinstance(t, int) and 0 <= t < 50 for t in out)
    # Unusable temperatures decode greedily; NaN/inf rows fall back to the argmax of the finite logits.
    assert out[:3] == logits[:3].argmax(dim=-1).tolist()
    assert out[4] == torch.nan_to_num(logits[4], nan=float("-inf")).argmax().item()
    assert out[6] == 9


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.0), (0.7, 3, 0.0), (1.5, 0, 0.8),
                                                     (1.3, 4, 0.9)])
def test_sampled_frequencies_match_truncated_softmax(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.5])
    draws = 4000
    rows = [_row(f"r{i}", temperature=temperature, top_k=top_k, top_p=top_p) for i in range(draws)]
    tokens = Sampler("cpu").sample(logits.expand(draws, -1), rows).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / draws
    scaled = (logits / temperature).unsqueeze(0)
    expected = apply_top_k_top_p(scaled, torch.tensor([top_k]), torch.tensor([top_p]))[0].softmax(-1)
    assert (freq - expected).abs().max() < 0.05
    assert freq[expected == 0].sum() == 0  # never a token outside top-k / top-p


def test_logprobs_are_raw_log_softmax_with_per_row_n():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4)) * 3
    rows = [_row("a", logprobs=2), _row("b", temperature=0.5, top_k=5, logprobs=5, seed=1),
            _row("c", temperature=1.0), _row("d", temperature=1.0, logprobs=1)]
    out = Sampler("cpu").sample(logits, rows)
    lp = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 2), (1, 5), (3, 1)]:
        got = out.logprobs[i]
        assert got is not None and len(got.top_ids) == n and len(got.top_logprobs) == n
        assert got.logprob == pytest.approx(lp[i, out.token_ids[i]].item(), abs=1e-6)
        top = torch.topk(lp[i], n)
        assert got.top_ids == top.indices.tolist()
        assert got.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert Sampler("cpu").sample(logits, [_row(r) for r in "abcd"]).logprobs == [None] * 4


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
    engine.inputs.eos_token_ids = frozenset({ref[4]})  # pretend this token is the model's eos
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


def test_min_tokens_holds_eos_stop_ids_and_stop_strings_back(make_engine):
    """EOS at the 2nd token would end the output; with min_tokens=8 the output is at least 8 tokens
    before a stop, and the first stop after that ends it (vLLM's semantics)."""
    ref = _greedy_reference(make_engine)
    ids = ref.new_token_ids
    engine = make_engine()
    engine.inputs.eos_token_ids = frozenset({ids[1]})  # pretend the 2nd token is the model's eos
    assert engine.generate("e", PROMPT, sampling=SamplingParams(max_tokens=24)).new_token_ids == ids[:2]
    out = engine.generate("m", PROMPT, sampling=SamplingParams(max_tokens=24, min_tokens=8))
    later = next((i for i in range(8, len(ids)) if ids[i] == ids[1]), None)  # the first eos it may honour
    assert out.new_token_ids == (ids if later is None else ids[:later + 1])
    assert len(out.new_token_ids) >= 8 and out.usage.completion_tokens == len(out.new_token_ids)
    assert out.finish_reason == (FinishReason.LENGTH if later is None else FinishReason.STOP)
    # A stop token id, likewise.
    stop = make_engine().generate("s", PROMPT, sampling=SamplingParams(max_tokens=24, stop_token_ids=[ids[0]],
                                                                        min_tokens=5))
    assert len(stop.new_token_ids) >= 5 and stop.new_token_ids == ids[:len(stop.new_token_ids)]
    # A stop string in the first tokens' text is not looked for; min_tokens=max_tokens gives all 24.
    first_text = engine.generate("t", PROMPT, sampling=SamplingParams(max_tokens=2, ignore_eos=True)).text
    stop_string = next(c for c in first_text if not c.isspace())
    held = make_engine().generate("h", PROMPT, sampling=SamplingParams(max_tokens=24, min_tokens=24,
                                                                       stop=[stop_string]))
    assert held.new_token_ids == ids and held.finish_reason == FinishReason.LENGTH
    early = make_engine().generate("x", PROMPT, sampling=SamplingParams(max_tokens=24, stop=[stop_string]))
    assert len(early.new_token_ids) <= 2  # without min_tokens the same stop string ends it at once


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5).validate(vocab_size=512)
    SamplingParams(max_tokens=0, min_tokens=5).validate(vocab_size=512)  # 0: the engine's default


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=-1),
                                 dict(stop=[""]), dict(stop_token_ids=[10**6]), dict(logprobs=10**6)])
def test_invalid_sampling_rejected(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad).validate(vocab_size=512)
