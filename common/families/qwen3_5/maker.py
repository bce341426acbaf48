"""Random Qwen3.5 checkpoints in Hugging Face format, offline (the Qwen3.5 part of the model maker).

`qwen3.5-9b` has the 9B-style shapes that transformers' Qwen3_5Config documents as its defaults (5.25;
the Hub was not reachable from here), with what issue 68 names: text hidden 4096, 32 layers of which every
4th is full attention (16 query heads, 4 KV heads of dim 256, a quarter of each head rotated), the others
Gated DeltaNet (16 key heads and 32 value heads of dim 128, a causal convolution of kernel 4),
intermediate 12288, vocabulary 248320, interleaved M-RoPE sections [11, 11, 10] over the 32 rotated
frequencies; vision: Qwen3-VL's tower (depth 27, width 1152, MLP 4304, 16 heads, 16-px patches merged
2x2, a 48x48 position table) without DeepStack, merged into the text width. rope_theta is the config
class's default (10000); the real checkpoint's may differ (a served checkpoint's config.json is read).

`qwen3.5-tiny` keeps each of these choices (the 3:1 hybrid stack, grouped value heads, partial rotary
with interleaved sections split as 11:11:10 splits 32, Qwen3-VL's image processor) at small widths, so it
runs on a CPU in seconds. The chat template is Qwen3-VL's (the real one adds thinking switches a tiny model
has no use for).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.families.qwen2_5_vl.maker import vision_token_ids, write_random_checkpoint
from common.families.qwen3_vl.maker import QWEN3_VL_IMAGE_PROCESSOR, build_qwen3_tokenizer
from common.model_maker import pick_preset

QWEN3_5_IMAGE_PROCESSOR = {**QWEN3_VL_IMAGE_PROCESSOR, "processor_class": "Qwen3VLProcessor"}


@dataclass(frozen=True)
class Qwen3_5Preset:
    """Shapes of one Qwen3.5 preset (fields not named here are Qwen3_5Config's defaults)."""

    name: str
    vision: dict
    text: dict
    vocab_size: int
    mrope_section: tuple[int, int, int]
    copies: str = "Qwen/Qwen3.5-9B"


QWEN3_5_PRESETS: dict[str, Qwen3_5Preset] = {
    "qwen3.5-tiny": Qwen3_5Preset(
        name="qwen3.5-tiny",
        # A 12x12 learned position grid: every test image's grid interpolates (as qwen3-vl-tiny's).
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=144),
        # 4 layers: 3 Gated DeltaNet, then full attention; head_dim 64 rotates 16 dims (8 frequencies).
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
        vocab_size=512, mrope_section=(3, 3, 2),
    ),
    "qwen3.5-9b": Qwen3_5Preset(
        name="qwen3.5-9b",
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    num_position_embeddings=2304),
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
        vocab_size=248320, mrope_section=(11, 11, 10),
    ),
}


def build_qwen3_5_config(preset: Qwen3_5Preset, tokenizer, config_class=None):
    """The Qwen3_5Config (or `config_class`, e.g. Qwen3_5MoeConfig) of a preset, token ids from the
    tokenizer."""
    from transformers import Qwen3_5Config

    config_class = config_class or Qwen3_5Config
    text = dict(vocab_size=preset.vocab_size, max_position_embeddings=262144, rms_norm_eps=1e-6,
                hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                full_attention_interval=4,
                bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": list(preset.mrope_section), "mrope_interleaved": True},
                **preset.text)
    vision = dict(hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=preset.text["hidden_size"], **preset.vision)
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        **vision_token_ids(tokenizer))


@torch.no_grad()
def qwen3_5_scale(model: torch.nn.Module, seed: int, gain: float) -> None:
    """make-model's shared init (common/model_maker._scale_init), then what it gets wrong here: Qwen3.5's
    RMSNorms scale by (1 + w), so their weights are centred on 0 (the shared N(1, 0.1) would double every
    norm), except the Gated DeltaNet's output norm, a plain w; its depthwise convolution's fan-in is the
    kernel (the shared rule reads dim 1, of size 1); its decay A = exp(A_log) is drawn as HF draws it
    (uniform in [0.01, 16]) and dt_bias at HF's 1, so that the state neither explodes nor forgets at
    once."""
    from common.model_maker import _scale_init

    _scale_init(model, seed, gain)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)

    def redraw(p: torch.Tensor, t: torch.Tensor) -> None:
        p.copy_(t.to(p))

    for module in model.modules():
        kind = type(module).__name__.replace("Qwen3_5Moe", "Qwen3_5")  # the MoE sibling's classes too
        if kind == "Qwen3_5RMSNorm":
            redraw(module.weight, torch.normal(0.0, 0.1, module.weight.shape, generator=gen))
        elif kind == "Qwen3_5GatedDeltaNet":
            conv = module.conv1d.weight
            redraw(conv, torch.normal(0.0, gain / conv.shape[-1] ** 0.5, conv.shape, generator=gen))
            redraw(module.A_log, torch.empty(module.A_log.shape).uniform_(0.01, 16, generator=gen).log())
            redraw(module.dt_bias, torch.ones(module.dt_bias.shape))


def make_qwen3_5_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                       dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                       vision_only: bool = False) -> Path:
    """Write a random Qwen3.5 checkpoint for `preset` into `out` and return its path."""
    from transformers import Qwen3_5ForConditionalGeneration

    spec = pick_preset(QWEN3_5_PRESETS, preset, "Qwen3.5")
    tokenizer = build_qwen3_tokenizer(spec.vocab_size, seed)
    return write_random_checkpoint(Qwen3_5ForConditionalGeneration, build_qwen3_5_config(spec, tokenizer),
                                   tokenizer, QWEN3_5_IMAGE_PROCESSOR, preset, spec.copies, out, seed,
                                   device, dtype, gain, progress, vision_only, scale=qwen3_5_scale)
