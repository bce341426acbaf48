"""FP8 checkpoints in the published layouts load, serve in FP8, and give their dequantized twin's tokens;
`--quantization fp8` quantizes a checkpoint at load; other quantizations are refused clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from common.checkpoint import CheckpointError
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.model.quant.formats import checkpoint_fp8_format
from decoder_svc.model.quant.fp8 import dequantize, per_channel_block, quantize_per_channel
from decoder_svc.model.quant.linear import Fp8Linear
from tests.oracle import greedy, make_image, run_all
from tests.quant.fp8_writer import write_fp8_checkpoint

PROMPTS = ["USER: <image>\nWhat is in the picture? ASSISTANT:", "the quick brown fox jumps over"]


def _engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = EngineConfig(model=model_dir, num_kv_blocks=64, **overrides)
    return LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))


def _tokens(engine: LLMEngine, n: int = 16) -> list[list[int]]:
    image = make_image(7)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, [image] if "<image>" in prompt else [], sampling=greedy(n))
    results = run_all(engine)
    assert all(r["error"] is None for r in results.values())
    return [results[str(i)]["tokens"] for i in range(len(PROMPTS))]


def _fp8_layers(engine: LLMEngine) -> list[Fp8Linear]:
    return [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]


CASES = {
    "ct-channel": dict(fmt="compressed-tensors", strategy="channel"),
    "ct-tensor": dict(fmt="compressed-tensors", strategy="tensor"),
    "ct-block": dict(fmt="compressed-tensors", strategy="block", block=(32, 32)),
    "ct-static-input": dict(fmt="compressed-tensors", strategy="channel", static_input=True),
    "fine-grained-with-head": dict(fmt="fine-grained", block=(32, 32), quantize_lm_head=True),
    # 48-row blocks do not tile the 64-row q/k/v shards: their scales are spread to one per row.
    "fine-grained-unaligned": dict(fmt="fine-grained", block=(48, 32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_checkpoint_gives_its_twins_tokens(case: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    fp8_dir, twin_dir = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(tiny_model_dir, fp8_dir, twin_dir, **CASES[case])
    engine = _engine(fp8_dir)
    layers = _fp8_layers(engine)
    assert len(layers) == 4 * engine.model_config.num_layers  # served in FP8, not dequantized at load
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    ours = _tokens(engine)
    twin = _tokens(_engine(twin_dir))
    assert ours == twin
    assert ours != _tokens(_engine(tiny_model_dir))  # FP8 rounding is visible: the test can fail
    assert len(set(ours[1])) > 4  # varied output, not one token repeated


def test_quantize_at_load_equals_per_channel_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Quantizing the fused q/k/v and gate/up matrices per row is quantizing each shard per row, so
    # `--quantization fp8` gives exactly the tokens of a per-channel compressed-tensors checkpoint.
    write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", tmp_path / "twin", "compressed-tensors")
    engine = _engine(tiny_model_dir, quantization="fp8")
    assert len(_fp8_layers(engine)) == 4 * engine.model_config.num_layers
    assert _tokens(engine) == _tokens(_engine(tmp_path / "twin"))


def test_bf16_twin_matches(tiny_model_dir: Path, tmp_path: Path) -> None:
    write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", tmp_path / "twin", "fine-grained")
    ours = _tokens(_engine(tmp_path / "fp8", dtype="bfloat16"), n=8)
    assert ours == _tokens(_engine(tmp_path / "twin", dtype="bfloat16"), n=8)


def test_quantize_per_channel_error_is_fp8_rounding() -> None:
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scales
    w[5] = 0
    q, scale = quantize_per_channel(w)
    back = dequantize(q, scale, per_channel_block(96))
    assert torch.equal(back[5], torch.zeros(96))
    rel = (back - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert rel.max() <= 2.0**-4  # e4m3: 3 mantissa bits, half an ulp at most relative to the row max


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq", "bits": 4}, "quantization 'awq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "channel"}}}},
     "format 'int-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}},
     "int 4-bit"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}},
     "kv_cache_scheme"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
])
def test_other_quantizations_are_refused(qc: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        checkpoint_fp8_format({"quantization_config": qc})


def test_engine_refuses_an_unsupported_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'gptq' is not supported"):
        _engine(tmp_path / "m")


def test_dummy_weights_need_no_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="--model: .* has no \\*.safetensors weights .*--load-format dummy"):
        _engine(bare)
    cfg = EngineConfig(model=bare, num_kv_blocks=64, load_format="dummy")
    engine = LLMEngine(cfg, LocalEmbeddingSource.for_engine(EngineConfig(model=tiny_model_dir)))
    engine.add_request("a", PROMPTS[1], sampling=greedy(12))
    tokens = run_all(engine)["a"]["tokens"]
    assert len(tokens) == 12 and len(set(tokens)) > 3  # drawn at a scale where output varies
    quantized = LLMEngine(EngineConfig(model=bare, num_kv_blocks=64, load_format="dummy", quantization="fp8"),
                          LocalEmbeddingSource.for_engine(EngineConfig(model=tiny_model_dir)))
    assert len(_fp8_layers(quantized)) == 4 * quantized.model_config.num_layers


@pytest.mark.parametrize("case", ["ct-channel", "ct-tensor", "ct-block", "fine-grained-unaligned"])
def test_two_ranks_serve_an_fp8_checkpoint_as_one(case: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each rank reads its slices of the FP8 weights and the scales that go with them (blocks kept where
    the slice follows them, one scale per row where it does not): TP=2 gives TP=1's tokens, which are the
    dequantized twin's."""
    fp8_dir, twin_dir = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(tiny_model_dir, fp8_dir, twin_dir, **CASES[case])
    split = _engine(fp8_dir, tensor_parallel_size=2)
    layers = _fp8_layers(split)
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert split.model_config.num_heads * 2 == json.loads((fp8_dir / "config.json").read_text())[
        "text_config"]["num_attention_heads"]  # a real split
    tokens = _tokens(split)
    split.close()
    assert tokens == _tokens(_engine(fp8_dir)) == _tokens(_engine(twin_dir))


def test_quantize_at_load_with_two_ranks(tiny_model_dir: Path, qwen3_model_dir: Path) -> None:
    """`--quantization fp8` with TP=2: each rank quantizes its own shard, the o/down projections' rows with
    their whole rows' scales (a max over the ranks), so TP=2 quantizes exactly as TP=1 and serves its
    tokens. The Qwen3-VL text prompt is one whose first token is a near-tie (top-2 logits 3.877 / 3.696)
    that per-shard scales flipped."""
    engine = _engine(tiny_model_dir, quantization="fp8", tensor_parallel_size=2)
    assert _fp8_layers(engine)
    tokens = _tokens(engine)
    engine.close()
    assert len(set(tokens[1])) > 4 and tokens != _tokens(_engine(tiny_model_dir))
    assert tokens == _tokens(_engine(tiny_model_dir, quantization="fp8"))
    chat = "<|im_start|>user\ntell me a story about cars<|im_end|>\n<|im_start|>assistant\n"
    answers = []
    for tp in (1, 2):
        engine = _engine(qwen3_model_dir, quantization="fp8", tensor_parallel_size=tp)
        answers.append(engine.generate("q", chat, [], sampling=greedy(8)).new_token_ids)
        engine.close()
    assert answers[0] == answers[1]


def test_a_split_through_column_blocks_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """48-column blocks: the o/down projections' 64 / 128 input columns split in two cut through them."""
    fp8_dir, twin_dir = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(tiny_model_dir, fp8_dir, twin_dir, fmt="fine-grained", block=(32, 48))
    with pytest.raises(CheckpointError, match="cut through the checkpoint's 48-column scale blocks"):
        _engine(fp8_dir, tensor_parallel_size=2)
