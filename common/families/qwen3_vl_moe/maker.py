"""Random Qwen3-VL-MoE checkpoints in Hugging Face format, offline (the Qwen3-VL-MoE part of the model maker).

`qwen3-vl-30b-a3b` has the shapes of `Qwen/Qwen3-VL-30B-A3B-Instruct`, which transformers' defaults are
not (Qwen3VLMoeTextConfig defaults to hidden 2048 but 24 layers, 16 KV heads, 60 experts of width 1408, 4
active). The Hub was not reachable from here; the text fields agree across public copies of that model's
config (Megatron-Bridge's and slime's model arguments for Qwen3-VL-30B-A3B-Instruct) and Qwen3-30B-A3B's
config.json, whose language model it is:

- text_config: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4,
  head_dim 128, intermediate_size 6144 (no dense layer uses it), moe_intermediate_size 768,
  num_experts 128, num_experts_per_tok 8, norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers
  [], vocab_size 151936, rms_norm_eps 1e-6, rope_theta 5e6, mrope_section [24, 20, 20] interleaved,
  attention_bias false, tie_word_embeddings false;
- vision_config: Qwen3-VL-8B's tower (depth 27, width 1152, MLP 4304, 16 heads, DeepStack [8, 16, 24])
  merged into the text width 2048; the image processor is Qwen3-VL's.

`qwen3-vl-moe-tiny` keeps these choices (Qwen3-VL-tiny's tower and attention, every layer sparse, several
experts with more than one active) at small widths; the experts' width differs from both the hidden size
and half of it, so that HF's loader and ours can tell its stacked tensors' layout from their shapes.

make-model's shared init reads a matrix's dim 1 as its fan-in; the experts are stacked [experts, out, in],
so `qwen3_moe_scale` redraws them per expert (and the router at make-model's matrix scale, so that tokens
spread over the experts).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.families.qwen2_5_vl.maker import write_random_checkpoint
from common.families.qwen3_vl.maker import (
    QWEN3_VL_IMAGE_PROCESSOR,
    Qwen3Preset,
    build_qwen3_config,
    build_qwen3_tokenizer,
)
from common.model_maker import pick_preset

QWEN3_MOE_PRESETS: dict[str, Qwen3Preset] = {
    "qwen3-vl-moe-tiny": Qwen3Preset(
        name="qwen3-vl-moe-tiny",
        vision=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=144,
                    deepstack_visual_indexes=[0, 1, 2]),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, moe_intermediate_size=48, num_experts=8,
                  num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        vocab_size=512, mrope_section=(6, 5, 5),
        copies="Qwen/Qwen3-VL-30B-A3B-Instruct",
    ),
    "qwen3-vl-30b-a3b": Qwen3Preset(
        name="qwen3-vl-30b-a3b",
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                  num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
        vocab_size=151936, mrope_section=(24, 20, 20),
        copies="Qwen/Qwen3-VL-30B-A3B-Instruct",
    ),
}


@torch.no_grad()
def qwen3_moe_scale(model: torch.nn.Module, seed: int, gain: float) -> None:
    """make-model's shared init, then each stacked expert matrix N(0, gain / sqrt(its fan-in)), the down
    projections (into the residual stream) further divided by sqrt(layers), as the shared rule scales
    a dense MLP's."""
    from common.model_maker import _scale_init

    _scale_init(model, seed, gain)
    redraw_experts(model, seed, gain)


@torch.no_grad()
def redraw_experts(model: torch.nn.Module, seed: int, gain: float) -> None:
    """Each stacked expert matrix N(0, gain / sqrt(its fan-in)), the down projections further divided by
    sqrt(layers) (the shared init reads a stacked tensor's dim 1 as its fan-in, which is wrong here)."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    layers = model.config.text_config.num_hidden_layers
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            std = gain / param.shape[-1] ** 0.5
            if name.endswith("down_proj"):
                std /= layers ** 0.5
            param.copy_(torch.normal(0.0, std, param.shape, generator=gen).to(param))


def make_qwen3_moe_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                         dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                         vision_only: bool = False) -> Path:
    """Write a random Qwen3-VL-MoE checkpoint for `preset` into `out` and return its path."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    spec = pick_preset(QWEN3_MOE_PRESETS, preset, "Qwen3-VL-MoE")
    tokenizer = build_qwen3_tokenizer(spec.vocab_size, seed)
    config = build_qwen3_config(spec, tokenizer, Qwen3VLMoeConfig)
    return write_random_checkpoint(Qwen3VLMoeForConditionalGeneration, config, tokenizer,
                                   QWEN3_VL_IMAGE_PROCESSOR, preset, spec.copies, out, seed, device, dtype,
                                   gain, progress, vision_only, scale=qwen3_moe_scale)
