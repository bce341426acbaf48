"""The decoder front end's input lanes: a text-only request never waits behind image work, and the
image lane refuses work past its cost bound (RESOURCE_EXHAUSTED) instead of queueing it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decoder_svc.input_lanes import InputLanes, InputOverloadedError


def test_text_requests_pass_image_work_and_the_image_lane_is_bounded():
    release = threading.Event()

    async def scenario() -> list[str]:
        lanes = InputLanes(text_threads=1, image_threads=1, max_pending_images=20)
        done: list[str] = []
        heavy = [asyncio.ensure_future(lanes.run(8, lambda: (release.wait(10), done.append("image"))))
                 for _ in range(2)]
        await asyncio.sleep(0.05)
        assert lanes.pending_images == 16
        # The image lane's one thread is blocked: a text request still completes.
        assert await asyncio.wait_for(lanes.run(0, lambda: "text"), 5) == "text"
        with pytest.raises(InputOverloadedError, match="at most 20"):
            await lanes.run(5, lambda: None)  # 16 + 5 > 20
        release.set()
        await asyncio.gather(*heavy)
        assert lanes.pending_images == 0
        assert await lanes.run(5, lambda: "fits") == "fits"  # the budget came back
        lanes.shutdown()
        return done

    assert asyncio.run(scenario()) == ["image", "image"]
