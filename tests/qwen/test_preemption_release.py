"""Preemption gives back every embedding a Qwen-VL request holds, for Qwen2.5-VL and Qwen3-VL (DeepStack
rows) as for LLaVA (tests/engine/test_release_timing.py): a KV pool far too small for the batch preempts
requests; each preemption releases all of the request's images (its KV is freed, its rows would be held
for nothing) and the recompute asks for them anew. The source NaN-fills released rows
(tests/fakes.py: PoisoningSource), so tokens equal to HF's prove the recompute read fresh ones."""

from __future__ import annotations

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.fakes import PoisoningSource
from tests.oracle import greedy, make_image, run_all

N = 6
USER, END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
ONE = USER + "<|vision_start|><|image_pad|><|vision_end|>what is in the picture?" + END
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TWO = USER + IMAGE + " or " + IMAGE + "?" + END
TEXT = USER + "describe a red car on the table" + END
# KV blocks (16 tokens each) too few for the four requests at once: 4-token images on Qwen2.5-VL's
# 28 px blocks, 64-token ones on Qwen3-VL's (its smallest image is 256x256).
POOLS = {"qwen2.5": 6, "qwen3": 14}


@pytest.fixture(params=list(POOLS))
def family(request):
    """(checkpoint, HF oracle, KV pool) of each family's tiny preset."""
    name = "qwen" if request.param == "qwen2.5" else "qwen3"
    return (request.getfixturevalue(f"{name}_model_dir"), request.getfixturevalue(f"{name}_oracle"),
            POOLS[request.param])


def test_preemption_releases_every_lease_and_recomputes_with_fresh_rows(family):
    model_dir, oracle, pool = family
    config = EngineConfig(model=model_dir, num_kv_blocks=pool, max_num_batched_tokens=13, max_num_seqs=4)
    source = PoisoningSource(LocalEmbeddingSource.for_engine(config))
    engine = LLMEngine(config, source)
    source.scheduler = engine.scheduler
    images = [make_image(31 + i, (56, 56)) for i in range(3)]
    cases = {"a": (ONE, images[:1]), "b": (TWO, images[1:]), "c": (TEXT, []), "d": (ONE, images[2:])}
    for rid, (prompt, imgs) in cases.items():
        source.requests[rid] = engine.add_request(rid, prompt, imgs, sampling=greedy(N))

    results = run_all(engine)
    preemptions = engine.stats().preemptions
    assert preemptions > 0, "nothing was preempted: the case is not covered"
    for rid, (prompt, imgs) in cases.items():
        assert results[rid]["error"] is None, rid
        assert results[rid]["tokens"] == oracle.generate(prompt, imgs, N), f"request {rid}"
    # One release of everything per preemption, and one as each request finishes (its last).
    whole = [r for r in source.releases if r.content_hash is None]
    last = {r.request_id: r for r in whole}
    preempted = [r for r in whole if r is not last[r.request_id]]
    assert len(preempted) == preemptions and len(whole) == len(cases) + preemptions, whole
    assert any(offset < r.num_computed_tokens for r in preempted for offset, _ in r.spans), (
        "no request was preempted after reaching an image: the case is not covered")
    assert source.gets_after_release == []
    assert engine.stats().kv_blocks_used == 0 and source.inner.num_leases == 0
    assert engine.scheduler.images.num_held == 0
