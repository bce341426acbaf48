"""The scheduler alone: synthetic requests, a fake embedding source, no model (vLLM's tests/v1/core is
the model for these). Each test drives schedule() and update_from_output() by hand, the way the engine
does, and checks budgets, image readiness, preemption, prefix hits, lookahead order, and that every end
of a request gives back its blocks and its embeddings.
"""

from __future__ import annotations

from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.request import FinishReason, ImagePlaceholder, Request, RequestStatus
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.scheduler import RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from decoder_svc.runner import ModelOutput, SamplerOutput
from tests.fakes import FakeSource

BLOCK = 4
IMAGE_TOKEN = 99


def make_request(rid: str, n_text: int, image_at: int | None = None, image_hash: str = "img-a",
                 first_token: int = 1) -> Request:
    """n_text text tokens, with a 4-token image inserted at image_at if given."""
    tokens = list(range(first_token, first_token + n_text))
    images = []
    if image_at is not None:
        tokens[image_at:image_at] = [IMAGE_TOKEN] * 4
        images = [ImagePlaceholder(offset=image_at, length=4, content_hash=image_hash, image=b"png")]
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_tokens=8, images=images)


def make_scheduler(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, ahead: int = 2
                   ) -> tuple[Scheduler, FakeSource]:
    source = FakeSource()
    blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(budget, max_seqs, ahead), blocks, source), source


def model_output(out: SchedulerOutput, token: int = 7) -> ModelOutput:
    """What a runner answers: `token` for every chunk that reaches its request's end."""
    n = sum(c.samples for c in out.chunks)
    return ModelOutput(SamplerOutput([token] * n, [None] * n))


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """The engine's step without a model: schedule(), then update_from_output() with `token` sampled."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(out, token))
    return out


def chunks_of(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {c.request.request_id: (c.start, c.num_tokens) for c in out.chunks}


def finish(scheduler: Scheduler, req: Request) -> None:
    scheduler.finish_request(req, FinishReason.ABORT)


def test_token_budget_is_shared_in_arrival_order_and_prefill_is_chunked():
    s, _ = make_scheduler(budget=16)
    a, b = make_request("a", 10), make_request("b", 10, first_token=100)
    s.add(a)
    s.add(b)
    assert chunks_of(step(s)) == {"a": (0, 10), "b": (0, 6)}
    # a decodes (1 token) before b's prefill goes on with the rest of the budget
    out = step(s)
    assert chunks_of(out) == {"a": (10, 1), "b": (6, 4)}
    assert out.num_batched_tokens == 5


def test_decodes_come_before_prefill_chunks_when_the_budget_is_short():
    s, _ = make_scheduler(budget=8)
    a = make_request("a", 4)
    s.add(a)
    step(s)  # a is decoding now
    b = make_request("b", 20, first_token=200)
    s.add(b)
    assert chunks_of(step(s)) == {"a": (4, 1), "b": (0, 7)}


def test_max_num_seqs_bounds_the_running_set():
    s, _ = make_scheduler(budget=64, max_seqs=2)
    reqs = [make_request(f"r{i}", 4, first_token=10 * i + 1) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert set(chunks_of(step(s))) == {"r0", "r1"}
    assert [r.request_id for r in s.waiting] == ["r2"]
    finish(s, reqs[0])
    assert "r2" in chunks_of(step(s))


def test_a_chunk_stops_before_an_image_that_is_not_ready_and_resumes_when_it_is():
    s, src = make_scheduler(budget=32)
    r = make_request("r", 8, image_at=4)  # tokens 0-3 text, 4-7 image, 8-11 text
    s.add(r)
    assert chunks_of(step(s)) == {"r": (0, 4)}  # a whole block before the image: admitted
    assert chunks_of(step(s)) == {}  # waits on the image; nothing else to do
    assert [(a.request_id, a.prefetch) for a in src.asks] == [("r", False)]
    src.ready_hashes.add("img-a")
    assert chunks_of(step(s)) == {"r": (4, 8)}
    # every image token is in KV: the image is released at once, not at the end of the request
    assert ("r", "img-a") in src.released


def test_a_request_that_would_gain_less_than_a_block_waits_in_the_queue_for_its_image():
    s, src = make_scheduler(budget=32)
    r = make_request("r", 8, image_at=2)
    s.add(r)
    out = step(s)
    assert chunks_of(out) == {} and list(s.waiting) == [r] and not s.running
    assert src.asks and src.asks[0].content_hash == "img-a"  # asked for all the same
    src.ready_hashes.add("img-a")
    assert chunks_of(step(s)) == {"r": (0, 12)}


def test_a_failed_image_fails_its_request_and_frees_everything():
    s, src = make_scheduler(budget=32)
    r = make_request("r", 8, image_at=4)
    s.add(r)
    step(s)
    src.failing_hashes.add("img-a")
    out = s.schedule()
    assert r.finish_reason == FinishReason.ERROR and "failed" in r.error
    assert s.blocks.stats().used_blocks == 0 and not src.held()
    updates = s.update_from_output(out, model_output(out))
    assert [(u.request, u.new_token_ids) for u in updates] == [(r, [])]
    assert not s.has_unfinished() and s.counters.failed == 1 and "r" not in s.requests


def test_prefix_hit_skips_cached_blocks_and_the_image_inside_them():
    s, src = make_scheduler(budget=64)
    src.ready_hashes.add("img-a")
    a = make_request("a", 12, image_at=4)  # 16 tokens: 4 blocks
    s.add(a)
    step(s)
    b = make_request("b", 12, image_at=4)  # the same tokens and image
    s.add(b)
    out = step(s)
    # The last token is never a hit (its logits are needed): 3 blocks hit, one left to compute.
    assert chunks_of(out)["b"] == (12, 4)
    assert b.num_cached_tokens == 12
    assert b.images[0].skipped_by_kv_reuse and ("b", "img-a") not in {(x.request_id, x.content_hash)
                                                                      for x in src.asks}


def test_another_image_at_the_same_place_shares_nothing_past_it():
    s, src = make_scheduler(budget=64)
    src.ready_hashes |= {"img-a", "img-b"}
    s.add(make_request("a", 12, image_at=4, image_hash="img-a"))
    step(s)
    b = make_request("b", 12, image_at=4, image_hash="img-b")
    s.add(b)
    assert chunks_of(step(s))["b"] == (4, 12)  # only the text block before the image is shared


def test_lookahead_asks_for_the_next_queued_requests_images_in_order_with_prefetch():
    s, src = make_scheduler(budget=8, max_seqs=1, ahead=2)
    s.add(make_request("run", 4))
    for i in range(4):
        s.add(make_request(f"q{i}", 8, image_at=4, image_hash=f"img-{i}", first_token=100 * (i + 1)))
    step(s)
    prefetched = [(a.request_id, a.content_hash) for a in src.asks if a.prefetch]
    assert prefetched == [("q0", "img-0"), ("q1", "img-1")]  # encoder_max_ahead = 2, in arrival order


def test_a_prefetched_image_is_asked_for_once_more_as_demand_when_prefill_reaches_it():
    """Lookahead asks at low priority; when the request's prefill reaches the image while it is still
    pending, the source hears it once as demand work (a remote encoder raises its queued job: without it a
    lookahead image waits behind every prefetch queued before it), and never again on later steps."""
    s, src = make_scheduler(budget=8, max_seqs=1, ahead=2)
    first = make_request("run", 4)
    s.add(first)
    queued = make_request("q0", 8, image_at=4, image_hash="img-0", first_token=100)
    s.add(queued)
    step(s)
    assert [(a.request_id, a.prefetch) for a in src.asks] == [("q0", True)]
    finish(s, first)
    for _ in range(3):  # q0 runs its text, then waits on the image: one demand ask in all
        step(s)
    assert [(a.request_id, a.prefetch) for a in src.asks] == [("q0", True), ("q0", False)]
    src.ready_hashes.add("img-0")
    assert chunks_of(step(s)) == {"q0": (4, 8)}  # the image and the text after it
    assert len(src.asks) == 2


def test_out_of_blocks_preempts_the_latest_request_which_frees_its_blocks_and_images():
    s, src = make_scheduler(num_blocks=4, budget=64)
    src.ready_hashes.add("img-a")
    a = make_request("a", 7)  # 2 blocks with its first decode
    b = make_request("b", 4, image_at=0, first_token=50)  # 8 tokens: 2 blocks
    s.add(a)
    s.add(b)
    step(s)
    assert s.blocks.num_free_blocks == 0
    out = step(s)  # b's decode needs a third block for it: b (the later) gives its blocks back
    assert out.preempted == [b] and chunks_of(out) == {"a": (7, 1)}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert ("b", None) in src.released and list(s.waiting) == [b]


def test_every_end_of_a_request_frees_its_blocks_and_embeddings():
    s, src = make_scheduler(budget=64, max_seqs=2)
    src.ready_hashes.add("img-a")
    done = make_request("f", 8, image_at=4)
    aborted = make_request("x", 8, image_at=4, first_token=40)
    queued = make_request("w", 8, image_at=4, first_token=80)
    for r in (done, aborted, queued):
        s.add(r)
    s.schedule()  # the images are asked for, blocks allocated; queued is looked ahead for
    assert list(s.waiting) == [queued] and src.held()
    for r in (done, aborted, queued):  # finish, abort and a request still queued leave the same way
        finish(s, r)
    assert s.blocks.stats().used_blocks == 0
    assert not src.held() and s.images.num_held == 0
    assert s.has_unfinished()  # their last updates are still to be reported
    assert [u.request for u in s.update_from_output(s.schedule(), None)] == [done, aborted, queued]
    assert not s.has_unfinished() and not s.requests


def test_update_from_output_appends_tokens_and_stops_on_eos_stop_tokens_and_length():
    s, _ = make_scheduler(budget=64)
    eos = make_request("eos", 4)
    eos.eos_token_ids = frozenset({5})
    stop = make_request("stop", 4, first_token=20)
    stop.sampling = SamplingParams(max_tokens=8, stop_token_ids=[9])
    length = make_request("len", 4, first_token=40)
    length.max_tokens = 2
    for r in (eos, stop, length):
        s.add(r)
    out = s.schedule()
    s.update_from_output(out, ModelOutput(SamplerOutput([3, 3, 3], [None] * 3)))
    assert [r.output_token_ids for r in (eos, stop, length)] == [[3], [3], [3]]
    assert not any(r.is_finished for r in (eos, stop, length))
    out = s.schedule()
    assert chunks_of(out) == {"eos": (4, 1), "stop": (4, 1), "len": (4, 1)}
    updates = s.update_from_output(out, ModelOutput(SamplerOutput([5, 9, 3], [None] * 3)))
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("eos", [5]), ("stop", [9]),
                                                                          ("len", [3])]
    assert [r.finish_reason for r in (eos, stop, length)] == [FinishReason.STOP, FinishReason.STOP,
                                                               FinishReason.LENGTH]
    assert not s.has_unfinished() and s.blocks.stats().used_blocks == 0 and s.counters.finished == 3
    # The runner hears of them with the next schedule, so it can drop their sampling state.
    assert sorted(s.schedule().finished_request_ids) == ["eos", "len", "stop"]


def test_an_aborted_request_is_reported_once_by_the_next_update():
    s, _ = make_scheduler(budget=64)
    a, b = make_request("a", 4), make_request("b", 4, first_token=20)
    s.add(a)
    s.add(b)
    step(s)
    s.finish_request(a, FinishReason.ABORT)
    s.finish_request(a, FinishReason.ERROR)  # ending an ended request does nothing
    assert s.get("a") is None and "a" in s.requests  # its id stays taken until it is reported
    out = s.schedule()
    assert chunks_of(out) == {"b": (4, 1)}
    updates = s.update_from_output(out, model_output(out))
    assert [(u.request.request_id, u.request.finish_reason, u.new_token_ids) for u in updates] == [
        ("a", FinishReason.ABORT, []), ("b", None, [7])]
    assert s.counters.aborted == 1 and s.counters.failed == 0 and "a" not in s.requests
    assert s.update_from_output(s.schedule(), None) == []  # nothing computed, nothing left to report
    assert isinstance(updates[0], RequestUpdate)


def test_a_request_ended_after_schedule_gets_no_token():
    s, _ = make_scheduler(budget=64)
    a, b, c = make_request("a", 4), make_request("b", 4, first_token=20), make_request("c", 4, first_token=40)
    for req in (a, b, c):
        s.add(req)
    out = s.schedule()
    assert [r.num_pending_outputs for r in (a, b, c)] == [1, 1, 1]
    s.finish_request(a, FinishReason.ERROR, "internal error: boom")  # e.g. its chunk could not be built:
    out.chunks = out.chunks[1:]  # the engine drops it before the runner sees the batch
    s.finish_request(c, FinishReason.ABORT)  # ended while its step ran: its sampled row is ignored
    updates = s.update_from_output(out, ModelOutput(SamplerOutput([7, 9], [None, None])))
    assert a.output_token_ids == [] and c.output_token_ids == []
    assert b.num_computed_tokens == 4 and b.output_token_ids == [7] and b.num_pending_outputs == 0
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("a", []), ("c", []), ("b", [7])]
