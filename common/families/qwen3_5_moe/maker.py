"""Random Qwen3.5-MoE checkpoints in Hugging Face format, offline (the Qwen3.5-MoE part of the model maker).

`qwen3.5-35b-a3b` has the shapes that transformers' Qwen3_5MoeConfig documents as its defaults for
`Qwen/Qwen3.5-35B-A3B` (5.25; the Hub was not reachable from here): text hidden 2048, 40 layers of which
every 4th is full attention (16 query heads, 2 KV heads of dim 256, a quarter of each head rotated), the
others Gated DeltaNet (16 key and 32 value heads of dim 128, a convolution of kernel 4); every MLP 256
experts of width 512, 8 per token, beside a shared expert of width 512; vocabulary 248320; the M-RoPE
sections split the 32 rotated frequencies 11:11:10 as Qwen3.5-9B's; vision: Qwen3.5's tower (Qwen3-VL's
without DeepStack: depth 27, width 1152) merged into the text width.

`qwen3.5-moe-tiny` keeps these choices (the 3:1 hybrid stack, several experts with more than one active,
a shared expert of its own width) at small widths, so it runs on a CPU in seconds. HF 5.x writes the
experts one module each (Qwen2-MoE's layout), as the released checkpoints keep them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.families.qwen2_5_vl.maker import write_random_checkpoint
from common.families.qwen3_5.maker import (
    QWEN3_5_IMAGE_PROCESSOR,
    Qwen3_5Preset,
    build_qwen3_5_config,
    qwen3_5_scale,
)
from common.families.qwen3_vl.maker import build_qwen3_tokenizer
from common.families.qwen3_vl_moe.maker import redraw_experts
from common.model_maker import pick_preset

QWEN3_5_MOE_PRESETS: dict[str, Qwen3_5Preset] = {
    "qwen3.5-moe-tiny": Qwen3_5Preset(
        name="qwen3.5-moe-tiny",
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=144),
        text=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=48, shared_expert_intermediate_size=40),
        vocab_size=512, mrope_section=(3, 3, 2), copies="Qwen/Qwen3.5-35B-A3B",
    ),
    "qwen3.5-35b-a3b": Qwen3_5Preset(
        name="qwen3.5-35b-a3b",
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    num_position_embeddings=2304),
        text=dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512),
        vocab_size=248320, mrope_section=(11, 11, 10), copies="Qwen/Qwen3.5-35B-A3B",
    ),
}


@torch.no_grad()
def qwen3_5_moe_scale(model: torch.nn.Module, seed: int, gain: float) -> None:
    """Qwen3.5's init (its (1 + w) norms, the Gated DeltaNet's convolution and decay), then each stacked
    expert matrix at its own fan-in (as Qwen3-VL-MoE's)."""
    qwen3_5_scale(model, seed, gain)
    redraw_experts(model, seed, gain)


def make_qwen3_5_moe_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                           dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                           vision_only: bool = False) -> Path:
    """Write a random Qwen3.5-MoE checkpoint for `preset` into `out` and return its path."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    spec = pick_preset(QWEN3_5_MOE_PRESETS, preset, "Qwen3.5-MoE")
    tokenizer = build_qwen3_tokenizer(spec.vocab_size, seed)
    config = build_qwen3_5_config(spec, tokenizer, Qwen3_5MoeConfig)
    return write_random_checkpoint(Qwen3_5MoeForConditionalGeneration, config, tokenizer,
                                   QWEN3_5_IMAGE_PROCESSOR, preset, spec.copies, out, seed, device, dtype,
                                   gain, progress, vision_only, scale=qwen3_5_moe_scale)
