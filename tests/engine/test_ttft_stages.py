"""The TTFT split (decoder_svc/engine/ttft_stages.py) from hand-made stamps, and the engine's stamps."""

from __future__ import annotations

import pickle

import pytest

from common.images import encode_png
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine.ttft_stages import RequestTimes, split_ttft

ONE = "USER: <image>\nWhat is this? ASSISTANT:"


def test_a_request_that_waited_for_its_image_splits_into_every_stage():
    times = RequestTimes(received=10.0, made=10.5, arrived=10.625, added=10.75, images_ready=12.0,
                         step_started=12.5, sampled=13.5)
    split = split_ttft(times, delivered=14.0)
    assert split == {"input": 0.5, "submit": 0.125, "inbox": 0.125, "encode": 1.25, "queue": 0.5,
                     "prefill": 1.0, "output": 0.5}
    assert sum(split.values()) == pytest.approx(4.0)


def test_stamps_never_reached_count_as_the_one_before():
    # No image waited for (a prefix hit or text), and the image arrived while the final step scheduled.
    assert split_ttft(RequestTimes(1.0, 1.5, 0.0, 2.0, 0.0, 2.5, 3.0), 3.5)["encode"] == 0.0
    in_process = split_ttft(RequestTimes(1.0, 1.5, 0.0, 2.0, 0.0, 2.5, 3.0), 3.5)  # never crossed a pipe
    assert in_process["submit"] == 0.0 and in_process["inbox"] == 0.5
    late = split_ttft(RequestTimes(1.0, 1.5, 1.75, 2.0, 2.75, 2.5, 3.0), 3.0)
    assert late["queue"] == 0.0 and late["encode"] == 0.75 and late["prefill"] == 0.25
    assert sum(late.values()) == pytest.approx(2.0)
    assert min(split_ttft(RequestTimes(received=5.0), 4.0).values()) >= 0.0


def test_the_latest_image_is_the_one_waited_for():
    times = RequestTimes()
    for t in (3.0, 5.0, 4.0):
        times.note_image_ready(t)
    assert times.images_ready == 5.0


def test_the_engine_stamps_a_request_up_to_its_first_token(make_engine, images):
    engine = make_engine()
    req = engine.add_request("r", ONE, [encode_png(images[0])],
                             sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    firsts = []
    while engine.has_unfinished():
        firsts += [o for o in engine.step() if o.times is not None]
    assert len(firsts) == 1 and firsts[0].new_token_ids  # only the first token's output carries them
    t = firsts[0].times
    assert 0 < t.added <= t.images_ready and t.added <= t.step_started < t.sampled
    assert t is req.times and pickle.loads(pickle.dumps(t)) == t  # they travel with outputs
