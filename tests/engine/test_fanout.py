"""n samples of one prompt (engine/fanout.py): the same tokens per choice as n separate requests seeded
seed+i, the prompt's image asked for once and its prefill done once, and nothing held after the choices
end, are cancelled, or could not share the KV."""

from __future__ import annotations

import pytest

from decoder_svc.engine import FinishReason, SamplingParams
from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.fanout import child_id, child_seed
from decoder_svc.engine.kv_cache_manager import KVCacheManager
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.request import Request
from decoder_svc.engine.sampling_params import InvalidRequestError
from decoder_svc.model.kv_groups import KVCacheGroup
from tests.fakes import GatedSource
from tests.oracle import greedy

ONE = "USER: <image>\nWhat is shown in this picture, and which colours? ASSISTANT:"
END = "USER: what is this picture of? <image>"  # the prompt's last token is an image's
SEED = 1234


def _engine(make_engine, tiny_model_dir, **kw):
    source = GatedSource(LocalEmbeddingSource(tiny_model_dir))
    return make_engine(source=source, **kw), source


def _sampled(max_tokens: int, seed: int | None = SEED) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def _choices(engine, max_steps: int = 10_000) -> dict[tuple[str, int], dict]:
    """Step until idle; per (request id, choice index): its tokens, finish reason and usage."""
    results: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return results
        for out in engine.step():
            r = results.setdefault((out.request_id, out.index), dict(tokens=[], finish=None))
            r["tokens"] += out.new_token_ids
            if out.finished:
                r.update(finish=out.finish_reason, usage=out.usage, error=out.error)
    raise AssertionError("engine did not finish")


def _separate(make_engine, tiny_model_dir, prompt, imgs, n, sampling) -> list[list[int]]:
    """Today's form: n requests, choice i seeded seed+i (the gateway's fan_out)."""
    engine, _ = _engine(make_engine, tiny_model_dir)
    for i in range(n):
        params = SamplingParams(**{**sampling.__dict__, "seed": child_seed(sampling.seed, i)})
        engine.add_request(f"s{i}", prompt, imgs, sampling=params)
    got = _choices(engine)
    return [got[(f"s{i}", 0)]["tokens"] for i in range(n)]


def _assert_nothing_held(engine, source) -> None:
    s = engine.stats()
    assert (s.kv_blocks_used, s.running, s.waiting) == (0, 0, 0)
    assert all(b.ref_cnt == 0 for b in engine.blocks.blocks)
    assert source.inner.num_leases == 0 and engine.scheduler.images.num_held == 0
    assert engine.outputs.num_followed == 0 and not engine.scheduler.requests
    assert not engine.scheduler.families and not engine.has_unfinished()


def test_n_samples_match_n_seeded_requests_with_one_image_ask_and_one_prefill(make_engine, tiny_model_dir,
                                                                             images):
    n, sampling = 4, _sampled(12)
    expected = _separate(make_engine, tiny_model_dir, ONE, images[:1], n, sampling)
    engine, source = _engine(make_engine, tiny_model_dir)
    req = engine.add_request("p", ONE, images[:1], sampling=sampling, n=n)
    got = _choices(engine)
    assert sorted(got) == [("p", i) for i in range(n)]
    assert [got[("p", i)]["tokens"] for i in range(n)] == expected
    assert len({tuple(t) for t in expected}) > 1  # the seeds differ: so do the choices
    assert all(got[("p", i)]["finish"] == FinishReason.LENGTH for i in range(n))
    s = engine.stats()
    # The prompt was looked up (admitted) once and its image asked for once; the other choices forked.
    assert s.prefix_cache_queried_tokens == req.num_prompt_tokens
    assert (s.samples_forked, s.samples_queued, s.requests_finished) == (n - 1, 0, n)
    assert len(source.asks) == 1 and s.images_encoded == 1 and s.images_encoder_cache_hits == 0
    assert all(got[("p", i)]["usage"].prompt_tokens == req.num_prompt_tokens for i in range(n))
    _assert_nothing_held(engine, source)


def test_greedy_samples_are_hf_greedy(make_engine, tiny_model_dir, hf_oracle, images):
    engine, source = _engine(make_engine, tiny_model_dir)
    engine.add_request("p", ONE, images[:1], sampling=greedy(8), n=3)
    got = _choices(engine)
    for i in range(3):
        hf_oracle.assert_same_tokens(got[("p", i)]["tokens"], ONE, images[:1], 8)
    _assert_nothing_held(engine, source)


def test_a_cancel_mid_stream_ends_every_choice_and_frees_everything(make_engine, tiny_model_dir, images):
    engine, source = _engine(make_engine, tiny_model_dir)
    engine.add_request("p", ONE, images[:1], sampling=_sampled(50), n=5)
    engine.add_request("other", ONE, images[1:2], sampling=greedy(50))
    outputs = []
    while sum(bool(o.new_token_ids) for o in outputs if o.request_id == "p") < 10:
        outputs += engine.step()
    assert engine.stats().samples_forked == 4
    assert engine.abort("p")
    assert not engine.abort("p")  # every choice has ended
    ended = [o for o in engine.step() if o.request_id == "p"]
    assert sorted(o.index for o in ended) == list(range(5))
    assert all(o.finish_reason == FinishReason.ABORT for o in ended)
    assert engine.abort("other")
    engine.step()
    _assert_nothing_held(engine, source)
    assert engine.stats().requests_aborted == 6


def test_samples_without_room_to_fork_are_queued_and_still_match(make_engine, tiny_model_dir, images):
    n, sampling = 4, _sampled(10)
    expected = _separate(make_engine, tiny_model_dir, ONE, images[:1], n, sampling)
    engine, source = _engine(make_engine, tiny_model_dir, max_num_seqs=2)
    engine.add_request("p", ONE, images[:1], sampling=sampling, n=n)
    got = _choices(engine)
    assert [got[("p", i)]["tokens"] for i in range(n)] == expected
    s = engine.stats()
    assert (s.samples_forked, s.samples_queued) == (1, 2)
    _assert_nothing_held(engine, source)


def test_a_prompt_ending_in_an_image_queues_its_samples(make_engine, tiny_model_dir, images):
    n, sampling = 3, _sampled(6)
    expected = _separate(make_engine, tiny_model_dir, END, images[:1], n, sampling)
    engine, source = _engine(make_engine, tiny_model_dir)
    engine.add_request("p", END, images[:1], sampling=sampling, n=n)
    got = _choices(engine)
    assert [got[("p", i)]["tokens"] for i in range(n)] == expected
    assert (engine.stats().samples_forked, engine.stats().samples_queued) == (0, n - 1)
    _assert_nothing_held(engine, source)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    blocks = BlockManager(8, block_size=4)
    parent = Request("p", list(range(10)), SamplingParams(), 4)
    assert blocks.allocate_slots(parent, 9)  # the prompt but its last token: blocks 0, 1 full, 2 partial
    parent.num_computed_tokens = 9
    child = Request(child_id("p", 1), parent.prompt_token_ids, SamplingParams(), 4)
    copy = blocks.fork(parent, child)
    p_table, c_table = blocks.block_table(parent), blocks.block_table(child)
    assert c_table[:2] == p_table[:2] and c_table[2] != p_table[2]
    assert copy == (p_table[2], c_table[2])
    assert [b.ref_cnt for b in blocks.req_blocks["p"]] == [2, 2, 1]
    blocks.free(parent)
    blocks.free(child)
    assert all(b.ref_cnt == 0 for b in blocks.blocks) and blocks.num_free_blocks == 8


def test_choice_seeds_are_seed_plus_index_wrapped_to_64_bits():
    assert [child_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert child_seed(2**64 - 1, 1) == 0 and child_seed(None, 3) is None


def test_a_sliding_group_forks_its_window_and_frees_every_block():
    m = KVCacheManager.for_groups([KVCacheGroup((0,), None, 16), KVCacheGroup((1,), 8, 16)], block_size=4)
    parent = Request("p", list(range(30)), SamplingParams(), 4)
    assert m.allocate_slots(parent, 29)
    parent.num_computed_tokens = 29
    m.allocate_slots(parent, 0)  # drops the sliding blocks that left the window
    child = Request(child_id("p", 1), parent.prompt_token_ids, SamplingParams(), 4)
    copies = m.fork(parent, child)
    (full_p, slide_p), (full_c, slide_c) = m.block_tables(parent), m.block_tables(child)
    assert full_c[:7] == full_p[:7] and full_c[7] != full_p[7]
    assert [b == 0 for b in slide_c] == [b == 0 for b in slide_p]  # null where the parent has left
    assert slide_c[:7] == slide_p[:7] and slide_c[7] != slide_p[7]
    assert copies == [(0, full_p[7], full_c[7]), (1, slide_p[7], slide_c[7])]
    m.free(parent)
    m.free(child)
    assert all(b.ref_cnt == 0 for b in m.blocks) and m.stats().used_blocks == 0


def test_forked_samples_preempted_for_blocks_recompute_to_the_same_tokens(make_engine, tiny_model_dir,
                                                                           images):
    n, sampling = 4, _sampled(40)
    expected = _separate(make_engine, tiny_model_dir, ONE, images[:1], n, sampling)
    engine, source = _engine(make_engine, tiny_model_dir, num_kv_blocks=14, block_size=16)
    engine.add_request("p", ONE, images[:1], sampling=sampling, n=n)
    got = _choices(engine)
    assert [got[("p", i)]["tokens"] for i in range(n)] == expected
    assert engine.stats().preemptions > 0 and engine.stats().samples_forked == n - 1
    _assert_nothing_held(engine, source)


def test_more_samples_than_served_is_refused(make_engine, tiny_model_dir):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="n must be"):
        engine.add_request("p", "USER: hi ASSISTANT:", n=129)
    with pytest.raises(InvalidRequestError, match="n must be"):
        engine.add_request("q", "USER: hi ASSISTANT:", n=0)


def test_a_failing_step_after_the_fork_fails_every_sample_and_frees_everything(make_engine, tiny_model_dir,
                                                                              images, monkeypatch):
    engine, source = _engine(make_engine, tiny_model_dir)
    engine.add_request("p", ONE, images[:1], sampling=_sampled(30), n=3)
    outputs = []
    while not any(o.new_token_ids for o in outputs):
        outputs += engine.step()
    for name in ("execute", "launch"):  # the synchronous and the asynchronous engine's call
        monkeypatch.setattr(engine.runner, name, lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    ended = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                ended[o.index] = o.finish_reason
    assert ended == {i: FinishReason.ERROR for i in range(3)}
    assert engine.stats().requests_failed == 3
    _assert_nothing_held(engine, source)
