"""The same image twice in one prompt shares one embedding key (decoder_svc/engine/image_inputs.py): a
prefix hit that covers the first copy must not give back the rows the second copy was just found ready
with (a heavy-load CI run scheduled such a chunk without its embedding: FusionError)."""

from __future__ import annotations

from decoder_svc.engine.embedding_source import EmbeddingState
from decoder_svc.engine.image_inputs import ImageInputs
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.engine.sampling_params import SamplingParams
from tests.fakes import FakeSource


def _two_copies() -> Request:
    images = [ImagePlaceholder(2, 4, "h", b"file"), ImagePlaceholder(10, 4, "h", b"file")]
    return Request("r", list(range(20)), SamplingParams(), 4, images=images)


def test_a_cached_copy_keeps_the_rows_another_copy_needs():
    source = FakeSource()
    inputs, req = ImageInputs(source), _two_copies()
    inputs.lookahead([(req, 0)])  # both asked for ahead: PENDING
    source.ready_hashes.add("h")
    assert inputs.readiness(req, req.images[1]) == EmbeddingState.READY  # the chunk after the hit
    inputs.skip_cached(req, hit=8)  # the prefix grew meanwhile: the first copy is in cached KV
    assert req.images[0].state == EmbeddingState.SKIPPED
    assert inputs.rows_for_chunk(req, 8, 16)[0].shape[0] == 4  # the second copy still has its rows
    assert source.held() == {("r", "h")}
    inputs.skip_cached(req, hit=16)  # both cached: now it goes back
    assert source.held() == set() and inputs.num_held == 0


def test_a_lone_cached_image_is_given_back():
    source = FakeSource()
    inputs = ImageInputs(source)
    req = Request("r", list(range(20)), SamplingParams(), 4, images=[ImagePlaceholder(2, 4, "h", b"f")])
    inputs.lookahead([(req, 0)])
    inputs.skip_cached(req, hit=8)
    assert source.held() == set() and req.images[0].skipped_by_kv_reuse
