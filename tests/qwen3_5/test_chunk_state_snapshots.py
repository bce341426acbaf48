"""Snapshots on fla's chunk bounds come from the chunked rule's own chunk states
(DeltaRuleKernels.chunk_states, model/fla_chunk_states.py on a GPU): a prompt whose image ends mid-prompt is
prefilled in one chunked call per linear layer instead of one per piece, and a new question about that image
resumes from the snapshot at the image's end taken down to a multiple of 64 tokens
(engine/state_snapshots.py). Tokens and the first token's logprob equal HF's either way. A CPU runs FakeFla
(fla's contract in torch, tests/qwen3_5/linear_steps.py) beside the real Triton kernels in Triton's
interpreter; tests/gpu runs fla itself."""

from __future__ import annotations

import pytest

from tests.oracle import waves_equal_hf
from tests.qwen3_5.linear_steps import INTERPRETED
from tests.qwen_prompts import END, USER, VISION

pytestmark = INTERPRETED

QUESTION = " ".join(["describe the shapes, their colours and where each one lies"] * 8)
FIRST = USER + VISION + QUESTION + END  # ~100 question tokens after the image
FOLLOW_UP = USER + VISION + "which colour covers the most of it?" + END


@pytest.mark.parametrize("states", [True, False], ids=["chunk-states", "cuts"])
def test_an_image_end_snapshot_without_a_cut(states, fake_fla_graphs, make_qwen3_5_engine, qwen3_5_oracle,
                                             qwen_images):
    fake_fla_graphs.states = states
    engine = make_qwen3_5_engine()
    linear_layers = sum(t == "linear_attention" for t in engine.model_config.layer_types)
    image = qwen_images[1:2]
    waves_equal_hf(engine, qwen3_5_oracle, [{"first": (FIRST, image)}], 1)
    # cut at the image's snapshot (its end taken down to a multiple of 64), the prompt's pieces before and
    # after it are two chunked calls a layer; read from the chunk states, one (the prompt's last tokens,
    # after its last block boundary, go token by token either way)
    assert len(fake_fla_graphs.chunk_calls) == (1 if states else 2) * linear_layers
    assert len(fake_fla_graphs.state_calls) == (linear_layers if states else 0)
    results = waves_equal_hf(engine, qwen3_5_oracle, [{"follow-up": (FOLLOW_UP, image)}], 6)
    placeholder = engine.inputs.make_request("probe", FIRST, image).images[0]
    end = placeholder.offset + placeholder.length
    assert end % 64 and end > 128  # an end off the chunk bounds, a few chunks in
    assert results["follow-up"]["usage"].cached_prompt_tokens == end // 64 * 64
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
