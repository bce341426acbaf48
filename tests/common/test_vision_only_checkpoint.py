"""`make-model --weights vision`: a Qwen-VL checkpoint with the vision tower's weights alone (for language
models too large to write), its tower the same as the whole preset's; the decoder serves it with
`--load-format dummy` and says so when asked to read language weights it does not have."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from common.checkpoint import CheckpointError, safetensors_files
from common.model_maker import make_model
from decoder_svc.engine import EngineConfig, LLMEngine, SamplingParams
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import make_image

QWEN_ONE = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is it?<|im_end|>\n"
            "<|im_start|>assistant\n")


def _weights(model_dir) -> dict:
    state = {}
    for path in safetensors_files(model_dir):
        state.update(load_file(path))
    return state


@pytest.mark.parametrize("preset,whole", [("qwen2.5-vl-tiny", "qwen_model_dir"),
                                          ("qwen3-vl-tiny", "qwen3_model_dir")])
def test_the_tower_alone_equals_the_whole_presets_tower(preset, whole, request, tmp_path):
    out = make_model(preset, tmp_path / preset, seed=0, device="cpu", progress=False, weights="vision")
    alone, full = _weights(out), _weights(request.getfixturevalue(whole))
    assert alone and all(name.startswith("model.visual.") for name in alone)
    # The whole checkpoint names the tower as the published one does ("visual." for Qwen2.5-VL).
    for name, tensor in alone.items():
        twin = full.get(name, full.get(name.removeprefix("model.")))
        assert twin is not None and twin.dtype == tensor.dtype and twin.equal(tensor), name
    assert len(alone) == sum("visual." in name for name in full)


def test_the_decoder_serves_it_with_dummy_language_weights(tmp_path):
    out = make_model("qwen2.5-vl-tiny", tmp_path / "q", device="cpu", progress=False, weights="vision")
    reading = EngineConfig(model=out, num_kv_blocks=64)
    with pytest.raises(CheckpointError, match="--load-format dummy"):
        LLMEngine(reading, LocalEmbeddingSource.for_engine(reading))
    cfg = EngineConfig(model=out, load_format="dummy", num_kv_blocks=64)
    engine = LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))
    try:
        result = engine.generate("r", QWEN_ONE, [make_image(1, (64, 48))],
                                 sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(result.new_token_ids) == 4 and engine.stats().kv_blocks_used == 0
    finally:
        engine.close()


def test_llava_presets_are_written_whole(tmp_path):
    with pytest.raises(ValueError, match="Qwen-VL presets"):
        make_model("tiny", tmp_path / "t", device="cpu", progress=False, weights="vision")
