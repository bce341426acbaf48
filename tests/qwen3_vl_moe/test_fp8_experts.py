"""FP8 experts (decoder_svc/model/quant/experts.py): `--quantization fp8` quantizes each MoE layer's stacked
experts per expert and output channel at load, and the layer computes with them (CPU: the torch reference,
each expert dequantized as TorchOps.fp8_linear does); FP8 checkpoints load when their experts stayed in
bf16 and are refused, with a message that says what to do, when their experts are FP8. End to end, the
FP8 engine's greedy tokens are HF's on the dequantized twin (the checkpoint with every quantized weight
replaced by its FP8 value): fp32 on a CPU, exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint import CheckpointError
from decoder_svc.model.loader import load_language_model
from decoder_svc.model.moe import Experts, experts_reference, route
from decoder_svc.model.quant.experts import Fp8Experts
from decoder_svc.model.quant.fp8 import FP8_DTYPE, dequantize, per_channel_block
from decoder_svc.model.quant.linear import Fp8Linear
from tests.quant.fp8_writer import write_fp8_checkpoint


@pytest.fixture(scope="module")
def models(qwen3_moe_model_dir):
    """(fp32 model, the same checkpoint with --quantization fp8), torch kernels on the CPU."""
    full = load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch")
    fp8 = load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", quantization="fp8")
    return full, fp8


def _dequantized(experts: Fp8Experts) -> tuple[torch.Tensor, torch.Tensor]:
    def one(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.stack([dequantize(q[e], scale[e], per_channel_block(q.shape[2])) for e in range(len(q))])

    return (one(experts.gate_up_proj, experts.gate_up_proj_scale),
            one(experts.down_proj, experts.down_proj_scale))


def test_quantization_fp8_makes_every_moe_layers_experts_fp8(models):
    full, fp8 = models
    for ours, theirs in zip(fp8.layers, full.layers, strict=True):
        experts = ours.mlp.experts
        assert isinstance(experts, Fp8Experts) and isinstance(theirs.mlp.experts, Experts)
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
        assert experts.gate_up_proj_scale.dtype == torch.float32  # not cast to the model dtype
        assert experts.gate_up_proj_scale.shape == (*experts.gate_up_proj.shape[:2], 1)
        assert isinstance(ours.self_attn.qkv_proj, Fp8Linear)
        assert ours.mlp.gate.weight.dtype == torch.float32  # the router stays in the model dtype
        gate_up, down = _dequantized(experts)
        for got, want in ((gate_up, theirs.mlp.experts.gate_up_proj), (down, theirs.mlp.experts.down_proj)):
            # e4m3 keeps 3 mantissa bits: each weight within 1/16 of its row's scale, the whole close
            assert ((got - want).norm() / want.norm()).item() < 0.05


def test_the_fp8_layer_computes_with_its_dequantized_experts(models):
    _, fp8 = models
    layer = fp8.layers[1].mlp
    x = torch.randn(13, fp8.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = layer(x)
        weights, ids = route(layer.gate(x), layer.top_k, layer.renormalize)
        want = experts_reference(x, weights, ids, *_dequantized(layer.experts))
    assert torch.equal(got, want)


def _dequantized_twin(src: Path, out: Path) -> Path:
    """A copy of src whose decoder projections and experts are what --quantization fp8 makes of them
    (quantized per output row, per expert for the stacked experts, dequantized to fp32)."""
    from decoder_svc.model.loader import rename_language_model_key
    from decoder_svc.model.quant.fp8 import quantize_per_channel

    shutil.copytree(src, out)
    text = json.loads((src / "config.json").read_text())["text_config"]
    rows = {"gate_up_proj": 2 * text["moe_intermediate_size"], "down_proj": text["hidden_size"]}
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def fp8_value(w: torch.Tensor) -> torch.Tensor:
        return dequantize(*quantize_per_channel(w), per_channel_block(w.shape[1]))

    def twin(tensors: dict) -> None:
        for name, w in tensors.items():
            ours = rename_language_model_key(name)
            if ours is None or not ours.startswith("layers."):
                continue
            if ours.endswith(".weight") and ours.rsplit(".", 2)[-2] in projections:
                tensors[name] = fp8_value(w)
            elif ".experts." in ours:
                assert w.shape[1] == rows[ours.rsplit(".", 1)[-1]], "HF 5.x's [experts, out, in]"
                tensors[name] = torch.stack([fp8_value(e) for e in w])

    return _retensor(src, out, twin)


def test_fp8_engine_gives_hfs_tokens_on_the_dequantized_twin(qwen3_moe_model_dir, make_qwen3_moe_engine,
                                                            tmp_path):
    from common.families.qwen3_vl_moe.oracle import Qwen3MoeOracle
    from tests.oracle import greedy

    twin = _dequantized_twin(qwen3_moe_model_dir, tmp_path / "twin")
    prompt = "<|im_start|>user\ndescribe a red car on the table<|im_end|>\n<|im_start|>assistant\n"
    engine = make_qwen3_moe_engine(quantization="fp8")
    assert isinstance(engine.model.layers[0].mlp.experts, Fp8Experts)
    got = engine.generate("r", prompt, [], sampling=greedy(12)).new_token_ids
    want = Qwen3MoeOracle(twin).generate(prompt, [], 12)
    assert got == want and len(set(want)) > 3


def _retensor(src: Path, out: Path, change) -> Path:
    """A copy of checkpoint `src` in `out` whose tensors `change(dict)` rewrites in place."""
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_fp8_checkpoints_with_bf16_experts_load(qwen3_moe_model_dir, tmp_path):
    out, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(qwen3_moe_model_dir, out, twin, "fine-grained", block=(16, 16))
    model = load_language_model(out, "cpu", torch.float32, "torch")
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert isinstance(model.layers[0].mlp.experts, Experts)  # stored in bf16/fp32: kept so


def test_fp8_checkpoints_with_fp8_experts_are_refused(qwen3_moe_model_dir, tmp_path):
    out, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_checkpoint(qwen3_moe_model_dir, out, twin, "fine-grained", block=(16, 16))

    def fp8_experts(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith("mlp.experts.down_proj")]:
            tensors[name] = tensors[name].to(FP8_DTYPE)
            tensors[name + "_scale_inv"] = torch.ones(tensors[name].shape[0], 1, 1)

    _retensor(out, out, fp8_experts)
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    with pytest.raises(CheckpointError, match="FP8 mixture-of-experts weights .* --quantization fp8"):
        load_language_model(out, "cpu", torch.float32, "torch")
