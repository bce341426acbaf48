"""n samples forked from one prefill on Gemma 3: the sliding-window group's blocks are forked too (its
last partial block copied like the full group's), and each sample has the tokens of a request of its own
seeded seed + i."""

from __future__ import annotations

import pytest

from tests.gemma3.conftest import sample_images
from tests.n_samples import check_samples_match_seeded_requests

PROMPT = "<start_of_turn>user\na red car at night: <start_of_image><end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_samples_fork_the_sliding_window(gemma3_tiny_dir, async_scheduling):
    check_samples_match_seeded_requests(gemma3_tiny_dir, PROMPT, sample_images()[:1],
                                        async_scheduling=async_scheduling)
