"""When the engine releases an image's embedding: only once every token of the image is in KV, or when the
request leaves (finish, abort, failure, preemption), where releasing all of it is right.

The source (tests/fakes.py: PoisoningSource) plays an encoder that reuses a released slice at once:
`get` hands out a private copy of the rows and `release` overwrites every copy handed out for the key
with NaN. A release before the image's last token is computed therefore shows twice: in the record of
`num_computed_tokens` at each release, and in the tokens, which stop matching HF.
"""

from __future__ import annotations

import pytest

from decoder_svc.engine import FinishReason
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.fakes import PoisoningSource
from tests.oracle import greedy, run_all

N = 8
TEXT = "USER: describe the red car on the table. ASSISTANT:"
ONE = "USER: <image>\nWhat is shown in this picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nwhich one has the blue sky? ASSISTANT:"
START = "<image>the cat on the tree"
END = "USER: what is this picture of? <image>"
TWICE = "USER: <image> versus <image>\nare they the same? ASSISTANT:"


def _engine(make_engine, tiny_model_dir, **kw):
    source = PoisoningSource(LocalEmbeddingSource(tiny_model_dir))
    engine = make_engine(source=source, **kw)
    source.scheduler = engine.scheduler
    return engine, source


def _add(engine, source, rid, prompt, imgs, n=N):
    source.requests[rid] = engine.add_request(rid, prompt, imgs, sampling=greedy(n))


def _assert_release_rules(source: PoisoningSource) -> None:
    """Every release of one image came after its last token was computed; every release of a whole
    request came as the request left the queues; no rows were read after their release."""
    assert source.releases, "nothing was released: the test proves nothing"
    for r in source.releases:
        if r.content_hash is None:
            assert not r.queued, f"{r.request_id}: all of its images released while it still runs: {r}"
            continue
        for offset, end in r.spans:
            # An image of that hash not started yet is fine: it is asked for again when reached.
            assert not offset < r.num_computed_tokens < end, (
                f"{r.request_id}: image at [{offset}, {end}) released with only {r.num_computed_tokens} "
                f"tokens computed: {r}")
        assert any(end <= r.num_computed_tokens for _, end in r.spans), f"released before any use: {r}"
    assert source.gets_after_release == []


def _released_one_by_one(source: PoisoningSource, rid: str) -> int:
    return sum(r.request_id == rid and r.content_hash is not None for r in source.releases)


@pytest.mark.parametrize("budget", [7, 13])
def test_images_released_only_after_their_last_token(make_engine, tiny_model_dir, hf_oracle, images, budget):
    """Chunks of 7 or 13 tokens split every 16-token image; each image is released (and its rows
    poisoned) only once its last token is computed, and the tokens still equal HF."""
    engine, source = _engine(make_engine, tiny_model_dir, max_num_batched_tokens=budget)
    cases = {"two": (TWO, images[1:3]), "end": (END, [images[0]]), "twice": (TWICE, [images[2], images[2]]),
             "text": (TEXT, [])}
    for rid, (prompt, imgs) in cases.items():
        _add(engine, source, rid, prompt, imgs)
    results = run_all(engine)
    for rid, (prompt, imgs) in cases.items():
        hf_oracle.assert_same_tokens(results[rid]["tokens"], prompt, imgs, N)
    _assert_release_rules(source)
    # Every image was released one by one while its request ran, not only by the final release of all.
    for rid in cases:
        req = source.requests[rid]
        one_by_one = {r.content_hash for r in source.releases if r.request_id == rid and r.content_hash}
        assert one_by_one == {img.content_hash for img in req.images}, rid
    assert engine.stats().kv_blocks_used == 0 and source.inner.num_leases == 0


def test_preemption_releases_everything_and_recomputes_with_fresh_rows(make_engine, tiny_model_dir,
                                                                        hf_oracle, images):
    """A pool far too small for the batch: preempted requests release all their images (right: their KV
    is freed) and ask for them again; the rows they had are poisoned, so tokens equal to HF prove the
    recompute read fresh ones."""
    engine, source = _engine(make_engine, tiny_model_dir, num_kv_blocks=6, max_num_batched_tokens=13,
                             max_num_seqs=4)
    cases = {"a": (ONE, images[:1]), "b": (TWO, images[1:3]), "c": (TEXT, []), "d": (END, [images[3]])}
    for rid, (prompt, imgs) in cases.items():
        _add(engine, source, rid, prompt, imgs)
    results = run_all(engine)
    preemptions = engine.stats().preemptions
    assert preemptions > 0
    for rid, (prompt, imgs) in cases.items():
        hf_oracle.assert_same_tokens(results[rid]["tokens"], prompt, imgs, N)
    _assert_release_rules(source)
    # One release of everything per preemption, and one as each request finishes.
    assert sum(r.content_hash is None for r in source.releases) == len(cases) + preemptions
    assert any(r.content_hash is None and any(o < r.num_computed_tokens < e for o, e in r.spans)
               for r in source.releases), "no request was preempted mid-image: the case is not covered"
    assert engine.stats().kv_blocks_used == 0 and source.inner.num_leases == 0


def test_abort_mid_image_releases_everything_only_then(make_engine, tiny_model_dir, hf_oracle, images):
    """Aborted while its image is half computed: the image is released with the request, never one by one
    before its end; a request running beside it is unaffected."""
    engine, source = _engine(make_engine, tiny_model_dir, max_num_batched_tokens=7)
    _add(engine, source, "aborted", START, [images[3]])  # the image is tokens [0, 16)
    _add(engine, source, "kept", ONE, images[:1])
    _add(engine, source, "queued", TWO, images[1:3])
    aborted = source.requests["aborted"]
    for _ in range(50):
        engine.step()
        if 0 < aborted.num_computed_tokens < 16:
            break
    assert 0 < aborted.num_computed_tokens < 16, "never caught mid-image"
    assert _released_one_by_one(source, "aborted") == 0
    assert engine.abort("aborted") and engine.abort("queued")
    results = run_all(engine)
    assert results["aborted"]["finish"] == results["queued"]["finish"] == FinishReason.ABORT
    hf_oracle.assert_same_tokens(results["kept"]["tokens"], ONE, images[:1], N)
    _assert_release_rules(source)
    ends = [r for r in source.releases if r.request_id == "aborted"]
    assert len(ends) == 1 and ends[0].content_hash is None and ends[0].num_computed_tokens < 16
    assert engine.stats().kv_blocks_used == 0 and source.inner.num_leases == 0
