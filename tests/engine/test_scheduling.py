"""Scheduler behaviour through the engine: images that are not ready, failures, KV reuse, lookahead,
abort, and that nothing leaks."""

from __future__ import annotations

from decoder_svc.engine import FinishReason
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.fakes import GatedSource
from tests.oracle import greedy, run_all

ONE = "USER: a <image>\nWhat is shown in this picture, and which colours? ASSISTANT:"
TEXT = "USER: describe the red car on the table. ASSISTANT:"


def _engine(make_engine, tiny_model_dir, **kw):
    source = GatedSource(LocalEmbeddingSource(tiny_model_dir))
    return make_engine(source=source, **kw), source


def _hash_of(engine, rid):
    return engine.scheduler.get(rid).images[0].content_hash


def test_unready_image_blocks_only_its_request(make_engine, tiny_model_dir, hf_oracle, images):
    engine, source = _engine(make_engine, tiny_model_dir, max_num_batched_tokens=64)
    req = engine.add_request("img", ONE, images[:1], sampling=greedy(12))
    source.closed.add(req.images[0].content_hash)
    engine.add_request("txt", TEXT, sampling=greedy(12))
    got: dict = {}
    for _ in range(30):
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    # The text request finished while the image request waited in the queue: the 5 tokens before its
    # image fill no block, so it is not admitted until the image is ready.
    assert len(got["txt"]) == 12 and "img" not in got
    assert req.num_computed_tokens == 0 and req in engine.scheduler.waiting
    source.closed.clear()
    rest = run_all(engine)
    hf_oracle.assert_same_tokens(rest["img"]["tokens"], ONE, images[:1], 12)
    hf_oracle.assert_same_tokens(got["txt"], TEXT, [], 12)


def test_same_image_waiting_together_is_computed_once(make_engine, tiny_model_dir, hf_oracle, images):
    """Requests that wait for the same image are admitted together once it is ready; the later ones find
    the first one's blocks (registered at allocation, written in the same step) and skip the image."""
    engine, source = _engine(make_engine, tiny_model_dir)
    reqs = [engine.add_request(f"r{i}", ONE, images[:1], sampling=greedy(8)) for i in range(3)]
    source.closed.add(reqs[0].images[0].content_hash)
    for _ in range(3):
        assert engine.step() == [] and all(r.num_computed_tokens == 0 for r in reqs)
    source.closed.clear()
    res = run_all(engine)
    for r in reqs:
        hf_oracle.assert_same_tokens(res[r.request_id]["tokens"], ONE, images[:1], 8)
    usages = [res[r.request_id]["usage"] for r in reqs]
    assert usages[0].cached_prompt_tokens == 0
    assert all(u.cached_prompt_tokens > 0 and u.images_skipped_by_kv_reuse == 1 for u in usages[1:])
    assert engine.stats().images_encoded + engine.stats().images_encoder_cache_hits == 1


def test_failed_image_fails_request_not_engine(make_engine, tiny_model_dir, images):
    engine, source = _engine(make_engine, tiny_model_dir)
    req = engine.add_request("bad", ONE, images[:1], sampling=greedy(8))
    source.failing.add(req.images[0].content_hash)
    engine.add_request("ok", TEXT, sampling=greedy(8))
    res = run_all(engine)
    assert res["bad"]["finish"] == FinishReason.ERROR and "encoder exploded" in res["bad"]["error"]
    assert res["ok"]["finish"] == FinishReason.LENGTH and len(res["ok"]["tokens"]) == 8
    assert engine.stats().requests_failed == 1 and engine.stats().kv_blocks_used == 0
    assert source.inner.num_leases == 0


def test_images_in_cached_prefix_are_never_requested(make_engine, tiny_model_dir, images):
    engine, source = _engine(make_engine, tiny_model_dir, max_num_batched_tokens=13)
    engine.generate("first", ONE, images[:1], sampling=greedy(4))
    asks_before = len(source.asks)
    out = engine.generate("second", ONE, images[:1], sampling=greedy(4))
    assert len(source.asks) == asks_before  # neither a demand nor a prefetch ask
    assert out.usage.images_skipped_by_kv_reuse == 1 and out.usage.cached_prompt_tokens > 0
    # Another image at the same place: the prefix stops before it and the encoder is asked.
    out = engine.generate("third", ONE, images[1:2], sampling=greedy(4))
    assert len(source.asks) == asks_before + 1 and out.usage.images_skipped_by_kv_reuse == 0
    offset = engine.tokenizer.encode_prompt(ONE, [None]).placeholders[0].offset
    assert out.usage.cached_prompt_tokens == offset // 16 * 16


def test_encoder_cache_hit_counted(make_engine, tiny_model_dir, images):
    engine, _ = _engine(make_engine, tiny_model_dir, enable_prefix_caching=False)
    a = engine.generate("a", ONE, images[:1], sampling=greedy(2))
    b = engine.generate("b", "<image> again", images[:1], sampling=greedy(2))
    assert a.usage.images_encoder_cache_hits == 0 and b.usage.images_encoder_cache_hits == 1
    s = engine.stats()
    assert (s.images_encoded, s.images_encoder_cache_hits) == (1, 1)


def test_lookahead_prefetches_queued_images(make_engine, tiny_model_dir, images):
    engine, source = _engine(make_engine, tiny_model_dir, max_num_seqs=1, encoder_max_ahead=2)
    for i in range(4):
        engine.add_request(f"r{i}", ONE, images[i:i + 1], sampling=greedy(2))
    engine.step()  # r0 runs; r1 and r2 are the next two in the queue
    prefetched = {a.request_id for a in source.asks if a.prefetch}
    assert prefetched == {"r1", "r2"}
    run_all(engine)
    assert source.inner.num_leases == 0


def test_abort_frees_everything(make_engine, tiny_model_dir, images):
    engine, source = _engine(make_engine, tiny_model_dir, max_num_batched_tokens=20)
    engine.add_request("mid-prefill", ONE, images[:1], sampling=greedy(50))
    engine.add_request("decoding", TEXT, sampling=greedy(50))
    engine.add_request("queued", ONE, images[1:2], sampling=greedy(50))
    for _ in range(4):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    for rid in ("mid-prefill", "decoding", "queued"):
        assert engine.abort(rid)
    assert not engine.abort("unknown")
    outs = engine.step()
    assert {o.request_id for o in outs} == {"mid-prefill", "decoding", "queued"}
    assert all(o.finish_reason == FinishReason.ABORT for o in outs)
    s = engine.stats()
    assert (s.kv_blocks_used, s.running, s.waiting, s.requests_aborted) == (0, 0, 0, 3)
    assert source.inner.num_leases == 0 and not engine.has_unfinished()


def test_nothing_held_after_all_requests_end(make_engine, tiny_model_dir, images):
    engine, source = _engine(make_engine, tiny_model_dir, num_kv_blocks=12, max_num_batched_tokens=24)
    for i in range(5):
        engine.add_request(f"r{i}", ONE if i % 2 else TEXT, images[i % 4:i % 4 + 1] if i % 2 else [],
                           sampling=greedy(10))
    run_all(engine)
    s = engine.stats()
    assert s.kv_blocks_used == 0 and s.kv_blocks_cached_free > 0 and s.requests_finished == 5
    assert s.running == s.waiting == 0 and source.inner.num_leases == 0
    assert all(b.ref_cnt == 0 for b in engine.blocks.blocks)
