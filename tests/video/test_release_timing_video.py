"""When the engine gives a video's embedding back: as an image's (tests/engine/test_release_timing.py), only
once no chunk still to come reads its rows. A video is one embedding whose rows fill one run of tokens
(Qwen2.5-VL) or one run per group of frames with timestamp text between (Qwen3-VL); its rows are kept
until its last run is computed, not given back after each run and asked for again (a new lease, or the
video decoded and encoded again once the encoder's cache has let it go).

The source plays an encoder that reuses a released slice at once (tests/fakes.py: PoisoningSource, rows
NaN-filled at release), so rows read after their release also show in the tokens, compared with HF's."""

from __future__ import annotations

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.embedding_source import VideoSource
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.fakes import PoisoningSource
from tests.oracle import greedy, run_all
from tests.video.test_engine_video import VIDEO, VIDEO_PROMPT, VideoOracle

N = 6
TEXT = "<|im_start|>user\ntell me a story<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(params=["qwen2.5", "qwen3"])
def family(request):
    """(checkpoint, video oracle) of each family's tiny preset."""
    name = "qwen" if request.param == "qwen2.5" else "qwen3"
    model_dir = request.getfixturevalue(f"{name}_model_dir")
    return model_dir, VideoOracle(request.getfixturevalue(f"{name}_oracle"), model_dir)


@pytest.mark.parametrize("budget", [7, 13])
def test_video_rows_kept_until_its_last_run_is_computed(family, budget):
    """Chunks of 7 or 13 tokens end inside and between the video's runs (beside a text request, so
    steps are shared): the video is asked for once, given back one by one once, after its last token."""
    model_dir, oracle = family
    config = EngineConfig(model=model_dir, num_kv_blocks=128, max_num_batched_tokens=budget)
    source = PoisoningSource(LocalEmbeddingSource.for_engine(config))
    engine = LLMEngine(config, source)
    source.scheduler = engine.scheduler
    video = source.requests["video"] = engine.add_request("video", VIDEO_PROMPT, videos=[VideoSource(VIDEO)],
                                                          sampling=greedy(N))
    source.requests["text"] = engine.add_request("text", TEXT, sampling=greedy(N))
    runs = video.images
    assert len({run.content_hash for run in runs}) == 1 and all(budget < run.length for run in runs)
    last_end = max(run.end for run in runs)

    results = run_all(engine)
    assert results["video"]["error"] is None
    assert results["video"]["tokens"] == oracle.generate(VIDEO_PROMPT, [], [VIDEO], N)
    one_by_one = [r for r in source.releases if r.request_id == "video" and r.content_hash is not None]
    assert len(one_by_one) == 1, f"the video was given back {len(one_by_one)} times while it ran"
    assert one_by_one[0].num_computed_tokens >= last_end, (
        f"given back at {one_by_one[0].num_computed_tokens} tokens computed; its last run ends at {last_end}")
    assert source.inner.num_requests == 1  # asked for once (then kept), not once per run
    assert source.gets_after_release == []
    assert engine.stats().kv_blocks_used == 0 and source.inner.num_leases == 0
    assert engine.scheduler.images.num_held == 0
