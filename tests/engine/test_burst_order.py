"""A burst of image requests (issue 65): the scheduler's ordering rule, pinned with a fake tower and a
fake clock (one tick per engine step; no wall clock).

The rule (decoder_svc/engine/scheduler.py, "Burst ordering"): the encoder is asked for images in arrival
order; requests whose embeddings are ready are prefilled in arrival order; when the token budget cannot
hold two prompts' chunks, the earlier prompt's are finished before the next prompt's first chunk (the
next one only takes what the earlier one leaves of the budget), so first tokens come in arrival order.
"""

from __future__ import annotations

from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.request import Request
from decoder_svc.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.engine.test_scheduler_unit import BLOCK, make_request, model_output
from tests.fakes import FakeSource

N_BURST = 32
BUDGET = 16
PROMPT_TEXT = 24  # text tokens around each 4-token image: 28-token prompts, more than the budget


class FakeTower:
    """Encodes the images it was asked for in the order of the asks, `per_tick` images per tick (one
    tick per engine step); `hold` keeps chosen images back until released."""

    def __init__(self, source: FakeSource, per_tick: int = 1) -> None:
        self.source, self.per_tick = source, per_tick
        self.hold: set[str] = set()
        self.encoded: list[str] = []

    def tick(self) -> None:
        queue = []
        for ask in self.source.asks:
            h = ask.content_hash
            if h not in self.source.ready_hashes and h not in self.hold and h not in queue:
                queue.append(h)
        for h in queue[:self.per_tick]:
            self.source.ready_hashes.add(h)
            self.encoded.append(h)


def _burst(n: int = N_BURST, budget: int = BUDGET, max_seqs: int = 64, per_tick: int = 1,
           image_at: int = 2) -> tuple[Scheduler, FakeSource, FakeTower, list[Request]]:
    source = FakeSource()
    blocks = BlockManager(512, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(budget, max_seqs, encoder_max_ahead=4), blocks, source)
    # 2 text tokens before each image: less than a block, so each request waits queued for its image
    reqs = [make_request(f"r{i:02d}", PROMPT_TEXT, image_at=image_at, image_hash=f"img-{i:02d}",
                         first_token=1000 * i)
            for i in range(n)]
    for req in reqs:  # all at once, in this order
        scheduler.add(req)
    return scheduler, source, FakeTower(source, per_tick), reqs


def _run(scheduler: Scheduler, tower: FakeTower, reqs: list[Request], max_ticks: int = 400
         ) -> tuple[dict[str, tuple[int, int]], list[SchedulerOutput]]:
    """Step until every request has its first token: the (tick, place among the step's chunks) of each
    one's first token, and the steps."""
    first: dict[str, tuple[int, int]] = {}
    steps = []
    for tick in range(max_ticks):
        tower.tick()
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(out))
        steps.append(out)
        for place, chunk in enumerate(out.chunks):
            if chunk.samples:
                first.setdefault(chunk.request.request_id, (tick, place))
        if len(first) == len(reqs):
            return first, steps
    raise AssertionError(f"only {len(first)} of {len(reqs)} first tokens in {max_ticks} ticks")


def _order(first: dict[str, tuple[int, int]]) -> list[str]:
    return sorted(first, key=lambda rid: first[rid])


def test_the_encoder_is_asked_for_the_burst_in_arrival_order():
    scheduler, source, _, reqs = _burst()
    scheduler.schedule()
    demand = [a.content_hash for a in source.asks if not a.prefetch]
    assert demand == [r.images[0].content_hash for r in reqs]


def test_with_a_short_queue_limit_demand_then_lookahead_asks_follow_arrival_order():
    scheduler, source, _, reqs = _burst(max_seqs=2)
    scheduler.schedule()
    asked = [a.content_hash for a in source.asks]
    # 2 seats: demand asks for the first two; lookahead's window (the queue's first 4, the two held
    # for their images among them) asks for the next ones
    assert asked == [r.images[0].content_hash for r in reqs[:4]]
    assert [a.prefetch for a in source.asks] == [False, False, True, True]


def test_first_tokens_of_a_burst_come_in_arrival_order():
    scheduler, _, tower, reqs = _burst()
    first, _ = _run(scheduler, tower, reqs)
    assert _order(first) == [r.request_id for r in reqs]
    assert tower.encoded == [r.images[0].content_hash for r in reqs]


def test_one_prompt_is_finished_before_the_next_one_starts_when_the_budget_cannot_hold_both():
    # The tower is ahead of the prefills (4 images a tick): several requests are ready at once.
    scheduler, _, tower, reqs = _burst(per_tick=4)
    first, steps = _run(scheduler, tower, reqs)
    assert _order(first) == [r.request_id for r in reqs]
    arrival = {r.request_id: i for i, r in enumerate(reqs)}
    started: list[str] = []
    for out in steps:
        prefill = [c for c in out.chunks if c.start < c.request.num_prompt_tokens]
        assert sum(c.num_tokens for c in out.chunks) <= BUDGET
        # Every prefill chunk but the step's last one finishes its prompt: at most one prompt is part
        # done, and it is the latest arrived of the step's.
        assert all(c.samples for c in prefill[:-1])
        assert [arrival[c.request.request_id] for c in prefill] == sorted(
            arrival[c.request.request_id] for c in prefill)
        started += [c.request.request_id for c in prefill if c.start == 0]
        # The budget is used whenever some ready prompt is unfinished (work-conserving).
        if prefill and not prefill[-1].samples:
            assert out.num_batched_tokens == BUDGET
    assert started == [r.request_id for r in reqs]  # first chunks in arrival order


def test_requests_admitted_before_their_image_still_finish_in_arrival_order():
    """With a block of text before each image, every request is admitted (its text prefilled) while its
    image is encoded: the running ones then go on in arrival order as their images come."""
    scheduler, _, tower, reqs = _burst(n=12, per_tick=3, image_at=2 * BLOCK)
    first, steps = _run(scheduler, tower, reqs)
    assert _order(first) == [r.request_id for r in reqs]
    started, done, most_part_done = set(), set(), 0
    for out in steps:
        prefill = [c for c in out.chunks if c.start < c.request.num_prompt_tokens]
        started |= {c.request.request_id for c in prefill}
        done |= {c.request.request_id for c in prefill if c.samples}
        most_part_done = max(most_part_done, len(started - done))
    assert most_part_done >= 2  # admitted prompts waited for their images side by side


def test_a_late_image_holds_back_only_its_own_request_which_keeps_its_place_after():
    """r01's image is held until tick 3 (r03's was ready at tick 1): r02 goes on meanwhile, and once r01
    is ready it comes before r03, which arrived after it."""
    scheduler, _, tower, reqs = _burst(n=6, per_tick=2)
    tower.hold.add(reqs[1].images[0].content_hash)
    first: dict[str, tuple[int, int]] = {}
    for tick in range(40):
        if tick == 3:
            tower.hold.clear()
        tower.tick()
        out = scheduler.schedule()
        scheduler.update_from_output(out, model_output(out))
        for place, chunk in enumerate(out.chunks):
            if chunk.samples:
                first.setdefault(chunk.request.request_id, (tick, place))
    assert reqs[3].images[0].content_hash in tower.encoded[:4]  # ready before r01's
    assert _order(first) == ["r00", "r02", "r01", "r03", "r04", "r05"]
