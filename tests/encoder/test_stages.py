"""An Encode's stage split (encoder_svc/stages.py) from hand-made stamps."""

from __future__ import annotations

import pytest

from common.stage_totals import StageTotals
from encoder_svc.stages import STAGES, JobTimes, split_encode


def test_a_miss_splits_its_wait_into_queue_preprocess_and_tower():
    job = JobTimes(submitted=2.0, prep_start=2.5, prep_end=3.0, tower_start=4.0, tower_end=6.0)
    split = split_encode(0.0, 0.5, 1.5, 2.0, 7.0, [job])
    assert split == {"receive": 0.5, "decode": 1.0, "queue": 0.5 + 1.5, "preprocess": 0.5, "tower": 2.0,
                     "handoff": 1.0}
    assert sum(split.values()) == pytest.approx(7.0)


def test_a_request_that_joined_a_running_encode_counts_only_its_own_wait():
    job = JobTimes(submitted=0.0, prep_start=0.0, prep_end=1.0, tower_start=2.0, tower_end=6.0)
    split = split_encode(3.0, 3.0, 3.0, 3.5, 6.5, [job])  # joined while the tower ran (admitted in 0.5)
    assert split["preprocess"] == 0.0 and split["tower"] == 2.5 and split["queue"] == 0.5
    assert sum(split.values()) == pytest.approx(3.5)


def test_a_hit_has_no_worker_stages_and_the_last_job_sets_the_wait():
    old = JobTimes(1.0, 1.0, 1.5, 1.5, 2.0)  # finished before this Encode waited: a hit
    split = split_encode(10.0, 10.1, 10.2, 10.3, 10.4, [old, None])
    assert split["queue"] == pytest.approx(0.1) and split["tower"] == 0.0 and split["preprocess"] == 0.0
    fast = JobTimes(0.0, 0.0, 0.1, 0.2, 1.0)
    slow = JobTimes(0.0, 0.0, 0.5, 1.0, 3.0)
    split = split_encode(0.0, 0.0, 0.0, 0.0, 3.0, [fast, slow])
    assert split["tower"] == 2.0 and split["preprocess"] == 0.5 and split["handoff"] == 0.0


def test_totals_sum_every_encode():
    totals = StageTotals(STAGES)
    totals.add(dict.fromkeys(STAGES, 1.0))
    totals.add(dict.fromkeys(STAGES, 0.5))
    seconds, calls = totals.snapshot()
    assert calls == 2 and seconds == dict.fromkeys(STAGES, 1.5)


def test_a_video_decoded_on_its_lane_counts_as_preprocess():
    job = JobTimes(submitted=5.0, prep_start=5.0, prep_end=5.5, tower_start=6.0, tower_end=8.0)
    split = split_encode(0.0, 0.0, 1.0, 1.0, 8.5, [job])  # the lane decoded from 1.0 to 5.0
    assert split["preprocess"] == 4.5 and split["queue"] == 0.5
    assert split["tower"] == 2.0 and split["decode"] == 1.0
    assert sum(split.values()) == pytest.approx(8.5)


def test_the_job_that_finished_last_sets_the_wait_whatever_its_place_in_the_list():
    slow = JobTimes(0.0, 0.0, 0.5, 1.0, 3.0)  # listed first, finished last
    fast = JobTimes(0.0, 0.0, 0.1, 0.2, 1.0)
    split = split_encode(0.0, 0.0, 0.0, 0.0, 3.0, [slow, fast, None])
    assert split["tower"] == 2.0 and split["preprocess"] == 0.5 and split["handoff"] == 0.0
