"""Our greedy tokens equal HF LlavaForConditionalGeneration.generate on the same checkpoint (fp32).

Whatever the chunk size, cache state, batch company or preemptions: the bar of the project.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle import greedy, run_all

N = 16
TEXT = "USER: describe the red car on the table. ASSISTANT:"
ONE = "USER: <image>\nWhat is shown in this picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nwhich one has the blue sky? ASSISTANT:"
START = "<image>the cat on the tree"
END = "USER: what is this picture of? <image>"


def _check(engine, oracle, prompt, imgs, n=N, rid="r"):
    out = engine.generate(rid, prompt, imgs, sampling=greedy(n))
    oracle.assert_same_tokens(out.new_token_ids, prompt, imgs, n)
    return out


def test_text_only(make_engine, hf_oracle):
    _check(make_engine(), hf_oracle, TEXT, [])


@pytest.mark.parametrize("budget", [7, 13, 64, 100_000])
def test_images_any_chunk_size(make_engine, hf_oracle, images, budget):
    """One image, two images, an image first and last, with chunks that split images at odd places."""
    engine = make_engine(max_num_batched_tokens=budget)
    cases = [(ONE, images[:1]), (TWO, images[1:3]), (START, [images[3]]), (END, [images[0]])]
    for i, (prompt, imgs) in enumerate(cases):
        out = _check(engine, hf_oracle, prompt, imgs, rid=f"r{i}")
        assert out.usage.images == len(imgs)
    assert engine.stats().kv_blocks_used == 0


def test_warm_prefix_cache_same_tokens(make_engine, hf_oracle, images):
    engine = make_engine(max_num_batched_tokens=13)
    cold = _check(engine, hf_oracle, TWO, images[1:3], rid="cold")
    warm = _check(engine, hf_oracle, TWO, images[1:3], rid="warm")
    assert cold.usage.cached_prompt_tokens == 0
    n_prompt = warm.usage.prompt_tokens
    assert warm.usage.cached_prompt_tokens == (n_prompt - 1) // 16 * 16 > 0
    # Both images lie inside the cached prefix: neither is asked for again.
    assert warm.usage.images_skipped_by_kv_reuse == 2
    stats = engine.stats()
    assert stats.images_skipped_by_kv_reuse == 2 and stats.images_encoded == 2
    assert stats.prefix_cache_hit_tokens == warm.usage.cached_prompt_tokens


def test_mixed_batch_staggered_arrivals(make_engine, hf_oracle, images):
    """Requests join at different steps, so decodes and prefill chunks share batches."""
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=3)
    plan = [(0, "a", ONE, images[:1]), (0, "b", TEXT, []), (2, "c", TWO, images[1:3]),
            (5, "d", START, [images[3]]), (6, "e", ONE, images[:1]), (9, "f", END, [images[2]])]
    results: dict = {}
    step = 0
    while step < 10 or engine.has_unfinished():
        for at, rid, prompt, imgs in plan:
            if at == step:
                engine.add_request(rid, prompt, imgs, sampling=greedy(N))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.last_step_num_tokens <= 24 and engine.stats().running <= 3
        step += 1
    for _, rid, prompt, imgs in plan:
        hf_oracle.assert_same_tokens(results[rid], prompt, imgs, N)
    assert engine.stats().kv_blocks_used == 0


def test_preemption_keeps_tokens(make_engine, hf_oracle, images):
    """A pool far too small for the batch: requests get preempted and recomputed, tokens still equal HF."""
    n = 20
    engine = make_engine(num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    cases = {"a": (ONE, images[:1]), "b": (TWO, images[1:3]), "c": (TEXT, []), "d": (END, [images[3]])}
    for rid, (prompt, imgs) in cases.items():
        engine.add_request(rid, prompt, imgs, sampling=greedy(n))
    results = run_all(engine)
    assert engine.stats().preemptions > 0
    for rid, (prompt, imgs) in cases.items():
        hf_oracle.assert_same_tokens(results[rid]["tokens"], prompt, imgs, n)
    assert engine.stats().kv_blocks_used == 0


def test_logprobs_match_hf(make_engine, hf_oracle, images):
    engine = make_engine(max_num_batched_tokens=13)
    out = engine.generate("lp", ONE, images[:1], sampling=greedy(N, logprobs=5))
    ref_tokens, ref_logits = hf_oracle.generate(ONE, images[:1], N)
    assert out.new_token_ids == ref_tokens
    ref_lp = torch.log_softmax(ref_logits, dim=-1)
    assert len(out.logprobs) == N
    for i, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(float(ref_lp[i, ref_tokens[i]]), abs=1e-4)
        top = torch.topk(ref_lp[i], 5)
        assert lp.top_ids[0] == ref_tokens[i]
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def test_chat_messages_equal_hf(make_engine, hf_oracle, images):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    prompt = hf_oracle.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = make_engine().generate("chat", None, images[:1], messages=messages, sampling=greedy(N))
    hf_oracle.assert_same_tokens(out.new_token_ids, prompt, images[:1], N)


@pytest.mark.parametrize("budget", [7, 100_000])
def test_same_image_twice_in_one_request(make_engine, hf_oracle, images, budget):
    """Both placeholders share one content hash: releasing after the first must not starve the second."""
    prompt = "USER: <image> versus <image>\nare they the same? ASSISTANT:"
    engine = make_engine(max_num_batched_tokens=budget)
    out = _check(engine, hf_oracle, prompt, [images[2], images[2]])
    assert out.usage.images == 2
    assert engine.source.num_leases == 0 and engine.stats().kv_blocks_used == 0
