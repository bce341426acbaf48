"""Random Qwen3-VL checkpoints in Hugging Face format, offline (the Qwen3-VL part of the model maker).

`qwen3-vl-8b` has the shapes of `Qwen/Qwen3-VL-8B-Instruct`. The Hub was not reachable from here; the
fields were copied from public copies of that repository's files (a mirror's preprocessor_config.json,
a fine-tune's config.json whose base is that model, and ollama's GGUF metadata of qwen3-vl:8b-instruct,
which agree with each other and with transformers' Qwen3VLVisionConfig defaults):

- config.json, vision_config: depth 27, hidden_size 1152, intermediate_size 4304, num_heads 16,
  hidden_act gelu_pytorch_tanh, patch_size 16, temporal_patch_size 2, spatial_merge_size 2,
  in_channels 3, num_position_embeddings 2304 (a 48x48 learned grid), deepstack_visual_indexes
  [8, 16, 24], out_hidden_size 4096;
- config.json, text_config: hidden_size 4096, intermediate_size 12288, num_hidden_layers 36,
  num_attention_heads 32, num_key_value_heads 8, head_dim 128, vocab_size 151936, rms_norm_eps 1e-6,
  max_position_embeddings 262144, rope_theta 5e6, mrope_section [24, 20, 20], mrope_interleaved true,
  attention_bias false, tie_word_embeddings false; image/video/vision start/end token ids
  151655/151656/151652/151653;
- preprocessor_config.json: size {shortest_edge 65536, longest_edge 16777216}, patch_size 16,
  temporal_patch_size 2, merge_size 2, image_mean = image_std = [0.5, 0.5, 0.5].

`qwen3-vl-tiny` keeps every one of these choices (dense text model, three DeepStack levels, interleaved
M-RoPE whose sections split the head as 24:20:20 does, the same image processor) at small widths, so it
runs on a CPU in seconds. Vocabulary ids are the tiny tokenizer's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.families.qwen2_5_vl.maker import build_qwen_tokenizer, vision_token_ids, write_random_checkpoint
from common.model_maker import pick_preset

# Qwen3-VL-8B-Instruct's chat template, its tool-calling branches left out (a tiny model cannot call
# tools): unlike Qwen2.5-VL's there is no default system turn; each image part becomes
# <|vision_start|><|image_pad|><|vision_end|>, each video part <|vision_start|><|video_pad|><|vision_end|>.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}{%- if 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-VL-8B-Instruct's preprocessor_config.json (the class name made portable when written).
QWEN3_VL_IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


@dataclass(frozen=True)
class Qwen3Preset:
    """Shapes of one Qwen3-VL preset (fields not named here are the 8B checkpoint's)."""

    name: str
    vision: dict
    text: dict
    vocab_size: int
    mrope_section: tuple[int, int, int]
    copies: str = "Qwen/Qwen3-VL-8B-Instruct"


QWEN3_PRESETS: dict[str, Qwen3Preset] = {
    "qwen3-vl-tiny": Qwen3Preset(
        name="qwen3-vl-tiny",
        # A 12x12 learned position grid: every test image's grid (16 to 62 patches a side) interpolates.
        vision=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=144,
                    deepstack_visual_indexes=[0, 1, 2]),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32),
        vocab_size=512, mrope_section=(6, 5, 5),  # 16 frequencies split as 24:20:20 splits 64
    ),
    "qwen3-vl-8b": Qwen3Preset(
        name="qwen3-vl-8b",
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128),
        vocab_size=151936, mrope_section=(24, 20, 20),
    ),
}


def build_qwen3_tokenizer(vocab_size: int, seed: int = 0):
    """A ChatML byte-level BPE tokenizer with the Qwen-VL vision tokens and Qwen3-VL's chat template."""
    tok = build_qwen_tokenizer(vocab_size, seed)
    tok.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tok


def build_qwen3_config(preset: Qwen3Preset, tokenizer, config_class: type | None = None):
    """The Qwen3VLConfig of a preset, token ids from the tokenizer (config_class: another config class
    of Qwen3-VL's fields, with the preset's text fields, e.g. the mixture-of-experts one)."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=preset.vocab_size, max_position_embeddings=262144, rms_norm_eps=1e-6,
                hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": list(preset.mrope_section),
                                 "mrope_interleaved": True, "rope_theta": 5000000.0},
                **preset.text)
    vision = dict(hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=preset.text["hidden_size"], **preset.vision)
    return (config_class or Qwen3VLConfig)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                           **vision_token_ids(tokenizer))


def make_qwen3_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                     dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                     vision_only: bool = False) -> Path:
    """Write a random Qwen3-VL checkpoint for `preset` into `out` and return its path."""
    from transformers import Qwen3VLForConditionalGeneration

    spec = pick_preset(QWEN3_PRESETS, preset, "Qwen3-VL")
    tokenizer = build_qwen3_tokenizer(spec.vocab_size, seed)
    return write_random_checkpoint(Qwen3VLForConditionalGeneration, build_qwen3_config(spec, tokenizer),
                                   tokenizer, QWEN3_VL_IMAGE_PROCESSOR, preset, spec.copies, out, seed,
                                   device, dtype, gain, progress, vision_only)
