"""The MoE layer (decoder_svc/model/moe.py) and the family's text config: the torch reference gives HF's
Qwen3VLMoeTextSparseMoeBlock's bits in fp32 (ties included), the stacked experts load from either layout,
the config's sparse/dense layers and normalisation are read as HF reads them, and a stack with dense
layers among the sparse ones equals HF's generate."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.checkpoint import CheckpointError
from decoder_svc.model.config import TextModelConfig
from decoder_svc.model.moe import SparseMoE, expert_weights_from_checkpoint
from decoder_svc.model.ops import TorchOps

HIDDEN, WIDTH, EXPERTS, TOP_K = 32, 24, 6, 3


def _text_config(**overrides) -> dict:
    cfg = dict(model_type="qwen3_vl_moe_text", vocab_size=64, hidden_size=HIDDEN, intermediate_size=40,
               num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               moe_intermediate_size=WIDTH, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
               rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True})
    cfg.update(overrides)
    return cfg


def _hf_block():
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    config = Qwen3VLMoeTextConfig(**{k: v for k, v in _text_config().items() if k != "model_type"})
    block = Qwen3VLMoeTextSparseMoeBlock(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block


def _ours(hf_block) -> SparseMoE:
    ours = SparseMoE(TextModelConfig.from_hf(_text_config()), TorchOps)
    ours.load_state_dict(hf_block.state_dict())
    return ours.eval()


def test_reference_gives_hfs_bits():
    hf = _hf_block()
    ours = _ours(hf)
    x = torch.randn(1, 37, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x)[0]
        got = ours(x[0])
    assert torch.equal(got, want)


def test_ties_in_the_router_route_as_hf():
    """A router whose logits tie for the k-th place (equal rows of its weight): the same experts are
    chosen, and the outputs are the same bits."""
    hf = _hf_block()
    with torch.no_grad():
        hf.gate.weight[3:] = hf.gate.weight[2]  # experts 2..5 tie for every token
    ours = _ours(hf)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x[None])[0])


def test_experts_load_from_either_layout():
    cfg = TextModelConfig.from_hf(_text_config())
    gate_up, down = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN), torch.randn(EXPERTS, HIDDEN, WIDTH)
    state = {"layers.0.mlp.experts.gate_up_proj": gate_up, "layers.0.mlp.experts.down_proj": down,
             "layers.1.mlp.experts.gate_up_proj": gate_up.transpose(1, 2).contiguous(),  # released layout
             "layers.1.mlp.experts.down_proj": down.transpose(1, 2).contiguous()}
    expert_weights_from_checkpoint(state, cfg)
    for layer in (0, 1):
        assert torch.equal(state[f"layers.{layer}.mlp.experts.gate_up_proj"], gate_up)
        assert torch.equal(state[f"layers.{layer}.mlp.experts.down_proj"], down)
    with pytest.raises(ValueError, match="neither"):
        expert_weights_from_checkpoint({"layers.0.mlp.experts.down_proj": torch.randn(EXPERTS, 5, 7)}, cfg)


def test_the_config_says_which_layers_are_sparse():
    cfg = TextModelConfig.from_hf(_text_config())
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (EXPERTS, TOP_K, WIDTH)
    assert [cfg.layer_is_moe(i) for i in range(4)] == [True] * 4 and cfg.moe_renormalize
    cfg = TextModelConfig.from_hf(_text_config(mlp_only_layers=[0], decoder_sparse_step=2))
    assert [cfg.layer_is_moe(i) for i in range(4)] == [False, True, False, True]  # HF: (i + 1) % step
    # HF 5.x saves num_experts as num_local_experts
    cfg = TextModelConfig.from_hf({k: v for k, v in _text_config(num_local_experts=5).items()
                                   if k != "num_experts"})
    assert cfg.num_experts == 5
    with pytest.raises(CheckpointError, match="norm_topk_prob false"):
        TextModelConfig.from_hf(_text_config(norm_topk_prob=False))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        TextModelConfig.from_hf(_text_config(num_experts_per_tok=EXPERTS + 1))


def test_dense_layers_among_sparse_ones_equal_hf(tmp_path):
    """mlp_only_layers: layer 1 keeps a dense MLP (HF's Qwen3VLMoeTextMLP, intermediate_size wide)."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from common.families.qwen2_5_vl.maker import write_random_checkpoint
    from common.families.qwen3_vl.maker import (
        QWEN3_VL_IMAGE_PROCESSOR,
        build_qwen3_config,
        build_qwen3_tokenizer,
    )
    from common.families.qwen3_vl_moe.maker import QWEN3_MOE_PRESETS, qwen3_moe_scale
    from common.families.qwen3_vl_moe.oracle import Qwen3MoeOracle
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource
    from tests.oracle import greedy

    tiny = QWEN3_MOE_PRESETS["qwen3-vl-moe-tiny"]
    spec = replace(tiny, text={**tiny.text, "mlp_only_layers": [1]})
    tokenizer = build_qwen3_tokenizer(spec.vocab_size, 0)
    out = write_random_checkpoint(Qwen3VLMoeForConditionalGeneration,
                                  build_qwen3_config(spec, tokenizer, Qwen3VLMoeConfig), tokenizer,
                                  QWEN3_VL_IMAGE_PROCESSOR, "qwen3-vl-moe-tiny", None, tmp_path / "m", 3,
                                  "cpu", None, 1.4, False, scale=qwen3_moe_scale)
    config = EngineConfig(model=out, num_kv_blocks=64, max_num_batched_tokens=2048)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    assert not engine.runner.model.layers[1].moe and engine.runner.model.layers[2].moe
    prompt = "<|im_start|>user\nname three colours<|im_end|>\n<|im_start|>assistant\n"
    got = engine.generate("r", prompt, [], sampling=greedy(10)).new_token_ids
    assert got == Qwen3MoeOracle(out).generate(prompt, [], 10)


def test_dummy_weights_scale_each_expert_by_its_fan_in(qwen3_moe_model_dir):
    """--load-format dummy (the 30B benchmark's weights): stacked experts drawn at gain / sqrt(fan-in),
    the down projections further by 1 / sqrt(layers), like a dense MLP's."""
    from decoder_svc.model.loader import load_language_model

    model = load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", load_format="dummy")
    experts, layers = model.layers[0].mlp.experts, model.config.num_layers
    hidden, width = model.config.hidden_size, model.config.moe_intermediate_size
    torch.testing.assert_close(experts.gate_up_proj.std().item(), 1.4 / hidden**0.5, rtol=0.05, atol=0)
    down = 1.4 / (width * layers) ** 0.5
    torch.testing.assert_close(experts.down_proj.std().item(), down, rtol=0.05, atol=0)


def test_dummy_weights_drawn_into_the_model_equal_the_drawn_state(qwen3_moe_model_dir):
    """Unquantized, --load-format dummy draws into the allocated model (the drawn copy and the model never
    take memory at once: a 30B MoE's 2 x 61 GB would not fit one 80 GB GPU); the values are those of the
    drawn state, which --quantization fp8 still quantizes."""
    from decoder_svc.model.dummy import dummy_state
    from decoder_svc.model.loader import load_language_model

    model = load_language_model(qwen3_moe_model_dir, "cpu", torch.float32, "torch", load_format="dummy")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    cfg = model.config
    drawn = dummy_state(shapes, cfg.num_layers, cfg.tie_word_embeddings, "cpu", torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(p, drawn[name]), name
