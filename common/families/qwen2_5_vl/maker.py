"""Random Qwen2.5-VL checkpoints in Hugging Face format, offline (the Qwen half of the model maker).

`qwen2.5-vl-tiny` copies the architecture fields of `Qwen/Qwen2.5-VL-7B-Instruct` (config.json and
preprocessor_config.json of that repository: window attention with full-attention blocks at every 4th
of 32 (here every 2nd of 4), 112-px windows, 14-px patches merged 2x2, temporal patch 2, SiLU gated
MLP in the tower, RMSNorm, M-RoPE sections [16, 24, 24] over a 128-dim head (here [2, 3, 3] over 16),
rope theta 1e6, q/k/v biases, untied head, ChatML with <|vision_start|><|image_pad|><|vision_end|>,
min_pixels 3136, max_pixels 12845056) at small widths. `qwen2.5-vl-7b` has the real shapes.
`qwen2.5-vl-72b` has the 72B's language model as transformers' `Qwen2_5_VLTextConfig` defaults give it
(80 layers, hidden 8192, 64 heads, 8 KV heads, MLP 29568, vocabulary 152064; the layer, width and head
counts match the config Qwen published with Qwen2.5-VL-72B-Instruct-AWQ) and the 7B's vision tower (the
72B's own tower config was not at hand; its merger outputs 8192). At 145 GB in bf16 it is meant to be made
with `--weights vision` and served with `--load-format dummy`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.model_maker import (
    CLIP_MEAN,
    CLIP_STD,
    build_tokenizer,
    finish_checkpoint,
    init_random,
    init_vision_only,
    pick_preset,
    prepare_output,
    write_preprocessor_config,
)

# Qwen2.5-VL's vision tokens, in the order of the real tokenizer's added tokens.
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PAD = "<|image_pad|>"

# The chat template Qwen2.5-VL-7B-Instruct ships (a default system turn; each image part becomes
# <|vision_start|><|image_pad|><|vision_end|>).
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384  # 3136 and 12845056, as Qwen2.5-VL-7B-Instruct

# Qwen2.5-VL-7B-Instruct's preprocessor_config.json (the class name made portable when written: the PIL
# and torchvision backends read the same file).
QWEN2_5_VL_IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "do_convert_rgb": True, "resample": 3, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
    "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
    "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}


@dataclass(frozen=True)
class QwenPreset:
    """Shapes of one Qwen2.5-VL preset (fields not named here are the 7B checkpoint's)."""

    name: str
    vision: dict
    text: dict
    vocab_size: int
    mrope_section: tuple[int, int, int]
    copies: str = "Qwen/Qwen2.5-VL-7B-Instruct"


# Qwen/Qwen2.5-VL-7B-Instruct's vision tower (its config.json's vision_config).
QWEN25_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                        fullatt_block_indexes=[7, 15, 23, 31])

QWEN_PRESETS: dict[str, QwenPreset] = {
    "qwen2.5-vl-tiny": QwenPreset(
        name="qwen2.5-vl-tiny",
        vision=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1, 3]),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vocab_size=512, mrope_section=(2, 3, 3),
    ),
    "qwen2.5-vl-7b": QwenPreset(
        name="qwen2.5-vl-7b",
        vision=QWEN25_7B_VISION,
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4),
        vocab_size=152064, mrope_section=(16, 24, 24),
    ),
    "qwen2.5-vl-72b": QwenPreset(
        name="qwen2.5-vl-72b",
        vision=QWEN25_7B_VISION,
        text=dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8),
        vocab_size=152064, mrope_section=(16, 24, 24),
        copies="transformers' Qwen2_5_VLTextConfig defaults (Qwen/Qwen2.5-VL-72B-Instruct's language "
               "model shapes) with the 7B's vision tower",
    ),
}


def build_qwen_tokenizer(vocab_size: int, seed: int = 0):
    """A ChatML byte-level BPE tokenizer with Qwen2.5-VL's vision tokens, exactly vocab_size ids."""
    tok = build_tokenizer(vocab_size - len(QWEN_VL_TOKENS), seed, "chatml")
    tok.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    tok.image_token = IMAGE_PAD
    tok.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    return tok


def build_qwen_config(preset: QwenPreset, tokenizer):
    """The Qwen2_5_VLConfig of a preset, token ids from the tokenizer."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=preset.vocab_size, max_position_embeddings=128000, rms_norm_eps=1e-6,
                hidden_act="silu", use_sliding_window=False, sliding_window=32768, max_window_layers=28,
                tie_word_embeddings=False, bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": list(preset.mrope_section),
                                 "rope_theta": 1000000.0},
                **preset.text)
    vision = dict(hidden_act="silu", in_channels=3, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2,
                  window_size=112, tokens_per_second=2, out_hidden_size=preset.text["hidden_size"],
                  **preset.vision)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            **vision_token_ids(tokenizer))


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The Qwen-VL configs' vision token id fields (Qwen2.5-VL's and Qwen3-VL's), from the tokenizer."""
    return {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", IMAGE_PAD), ("video_token_id", "<|video_pad|>"))}


def make_qwen_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                    dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                    vision_only: bool = False) -> Path:
    """Write a random Qwen2.5-VL checkpoint for `preset` into `out` and return its path."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    spec = pick_preset(QWEN_PRESETS, preset, "Qwen2.5-VL")
    tokenizer = build_qwen_tokenizer(spec.vocab_size, seed)
    return write_random_checkpoint(Qwen2_5_VLForConditionalGeneration, build_qwen_config(spec, tokenizer),
                                   tokenizer, QWEN2_5_VL_IMAGE_PROCESSOR, preset, spec.copies, out, seed,
                                   device, dtype, gain, progress, vision_only)


def write_random_checkpoint(model_cls, config, tokenizer, image_processor: dict, preset: str,
                            copies: str | None, out: str | Path, seed: int, device: str | None,
                            dtype: str | None, gain: float, progress: bool,
                            vision_only: bool = False, scale=None) -> Path:
    """Init model_cls(config) at make-model's scale on `device` and write it, the tokenizer, the image
    processor config (image_processor, as preprocessor_config.json) and mmserve_model.json into `out`
    (the Qwen-VL presets' maker). vision_only: write the vision tower's weights alone (the decoder serves
    such a checkpoint with `--load-format dummy`), for language models too large to write. scale: the
    family's own weight init (init_random's), where the shared one does not fit its modules."""
    from tqdm.auto import tqdm

    out, device, torch_dtype = prepare_output(out, device, dtype,
                                              torch.float32 if "tiny" in preset else torch.bfloat16)
    steps = tqdm(total=3, desc=f"make-model {preset}", disable=not progress, unit="step")
    t0 = time.perf_counter()
    steps.update()
    if vision_only:
        from safetensors.torch import save_file

        model = init_vision_only(model_cls, config, device, torch_dtype, seed, gain)
        weights = {name: t.contiguous() for name, t in model.state_dict().items() if not t.is_meta}
        save_file(weights, str(out / "model-vision.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
    else:
        model = init_random(model_cls, config, device, torch_dtype, seed, gain, scale)
        model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    steps.update()
    tokenizer.save_pretrained(out)
    write_preprocessor_config(out, image_processor)
    finish_checkpoint(out, preset=preset, copies=copies, seed=seed, gain=gain, torch_dtype=torch_dtype,
                      device=device, started=t0, language_weights=not vision_only)
    steps.update()
    steps.close()
    return out
