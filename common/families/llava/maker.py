"""LLaVA's `make-model` presets: random LLaVA-family checkpoints in Hugging Face format, offline.

`mmserve make-model --preset tiny --out DIR` writes config, safetensors weights, a byte-level BPE
tokenizer trained locally, a chat template and the image processor config, so that both
`AutoProcessor.from_pretrained(DIR)` and `LlavaForConditionalGeneration.from_pretrained(DIR)` work with
no network. Weights are drawn at a larger scale than the usual 0.02 init: a model at the usual scale
repeats one token forever, which makes parity tests against Hugging Face prove little.

Besides tiny/small/llava-1.5-7b, three presets copy the architecture of the LLaVA-family checkpoints
people run (vision tower type, image size, patch, feature strategy and layer, text architecture, rope,
tied embeddings, chat template) at small widths, so CI checks each against Hugging Face on a CPU:
llava-1.5-tiny (llava-hf/llava-1.5-7b-hf), bakllava-tiny (llava-hf/bakLlava-v1-hf) and
llava-interleave-qwen-tiny (llava-hf/llava-interleave-qwen-0.5b-hf).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.model_maker import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGE_TOKEN,
    build_tokenizer,
    finish_checkpoint,
    init_random,
    make_processor_configs_portable,
    pick_preset,
    prepare_output,
)

if TYPE_CHECKING:
    from transformers import LlavaConfig

# In-order LLaVA-1.5 conversation format: "USER: <image>\nWhat is this? ASSISTANT:".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# The chat template llava-hf ships with llava-1.5-7b-hf: images first, then text, "ASSISTANT:" to answer.
LLAVA_15_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}"
    "{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# llava-interleave-qwen's ChatML template: per message, its images, then its text, then <|im_end|>.
INTERLEAVE_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}"
    "{% endfor %}{# Render all text next #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}{{'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Shapes of one checkpoint preset."""

    name: str
    vision: dict
    text: dict  # shapes, plus any text-config field to override (rope_theta, sliding_window, ...)
    image_size: int
    vocab_size: int
    projector_hidden_act: str = "gelu"
    extra: dict = field(default_factory=dict)
    vision_type: str = "clip"  # clip (CLS row, CLIP processor) or siglip (no CLS, resize to a square)
    text_type: str = "llama"  # llama, mistral or qwen2
    select_strategy: str = "default"
    feature_layer: int | list[int] = -2
    tie_word_embeddings: bool = False
    tokenizer_style: str = "llama"  # llama (<s> first) or chatml (no BOS, ChatML tokens: Qwen2's)
    chat_template: str = CHAT_TEMPLATE
    copies: str = ""  # the real checkpoint whose architecture fields this preset copies

    @property
    def num_image_tokens(self) -> int:
        """Image tokens per image: patches, plus the CLS row under "full" for CLIP."""
        patches = (self.image_size // self.vision["patch_size"]) ** 2
        has_cls = self.vision_type == "clip"
        return patches + int(has_cls) - (1 if self.select_strategy == "default" else 0)


PRESETS: dict[str, Preset] = {
    # 16 image tokens, 2+2 layers: builds and loads in about a second on a CPU.
    "tiny": Preset(
        name="tiny",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    patch_size=7, projection_dim=32),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024),
        image_size=28,
        vocab_size=512,
    ),
    # 64 image tokens, 4+4 layers: for CPU load tests.
    "small": Preset(
        name="small",
        vision=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    patch_size=14, projection_dim=128),
        text=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=2048),
        image_size=112,
        vocab_size=2048,
    ),
    # The real shapes: CLIP ViT-L/14-336 (576 image tokens) and Llama-2-7B.
    "llava-1.5-7b": Preset(
        name="llava-1.5-7b",
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    patch_size=14, projection_dim=768),
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=4096),
        image_size=336,
        vocab_size=32064,
    ),
    # The three below copy real checkpoints' architecture fields at small widths (CPU parity tests).
    # CLIP ViT-L/14-336 (576 image tokens, the CLS row dropped, layer -2) + Llama-2: llava-1.5-7b-hf.
    "llava-1.5-tiny": Preset(
        name="llava-1.5-tiny",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    patch_size=14, projection_dim=32),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
                  rms_norm_eps=1e-5),
        image_size=336, vocab_size=512, chat_template=LLAVA_15_CHAT_TEMPLATE,
        copies="llava-hf/llava-1.5-7b-hf",
    ),
    # The same CLIP tower + Mistral-7B (GQA 4:1, 4096-token sliding window): bakLlava-v1-hf.
    "bakllava-tiny": Preset(
        name="bakllava-tiny",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    patch_size=14, projection_dim=32),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=32768, rope_theta=10000.0,
                  rms_norm_eps=1e-5, sliding_window=4096),
        image_size=336, vocab_size=512, text_type="mistral", chat_template=LLAVA_15_CHAT_TEMPLATE,
        copies="llava-hf/bakLlava-v1-hf",
    ),
    # SigLIP so400m/14-384 (27x27 = 729 patches, no CLS row, "full", last layer, no pooling head) +
    # Qwen1.5-0.5B-Chat (q/k/v biases, rope theta 1e6, tied embeddings, ChatML): llava-interleave-qwen.
    "llava-interleave-qwen-tiny": Preset(
        name="llava-interleave-qwen-tiny",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    patch_size=14),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=32768, max_window_layers=21),
        image_size=384, vocab_size=512, vision_type="siglip", text_type="qwen2", select_strategy="full",
        feature_layer=-1, tie_word_embeddings=True, tokenizer_style="chatml",
        chat_template=INTERLEAVE_QWEN_CHAT_TEMPLATE, copies="llava-hf/llava-interleave-qwen-0.5b-hf",
    ),
}


def build_config(preset: Preset, tokenizer) -> LlavaConfig:
    """The LlavaConfig of a preset, with token ids taken from the tokenizer."""
    import transformers
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

    if preset.vision_type == "siglip":  # so400m: tanh GELU, eps 1e-6, LLaVA does not use the pooling head
        vision = SiglipVisionConfig(image_size=preset.image_size, hidden_act="gelu_pytorch_tanh",
                                    layer_norm_eps=1e-6, vision_use_head=False, **preset.vision)
    else:
        vision = CLIPVisionConfig(image_size=preset.image_size, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                                  **preset.vision)
    text_cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}[preset.text_type]
    text_fields = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, **preset.text}
    text = getattr(transformers, text_cls)(
        vocab_size=preset.vocab_size, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=preset.tie_word_embeddings, **text_fields,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        projector_hidden_act=preset.projector_hidden_act,
        vision_feature_select_strategy=preset.select_strategy, vision_feature_layer=preset.feature_layer,
        image_seq_length=preset.num_image_tokens,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=preset.tie_word_embeddings,
    )


def make_llava_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                     dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                     vision_only: bool = False) -> Path:
    """Write a random LLaVA-family checkpoint for `preset` (one of PRESETS) into `out`; its path."""
    from tqdm.auto import tqdm
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    if vision_only:
        raise ValueError("weights='vision' is for the Qwen-VL presets; the LLaVA presets are written whole")
    spec = pick_preset(PRESETS, preset, "LLaVA")
    out, device, torch_dtype = prepare_output(
        out, device, dtype, torch.bfloat16 if preset == "llava-1.5-7b" else torch.float32)
    steps = tqdm(total=4, desc=f"make-model {preset}", disable=not progress, unit="step")
    t0 = time.perf_counter()

    steps.set_postfix_str("tokenizer")
    tokenizer = build_tokenizer(spec.vocab_size, seed, spec.tokenizer_style)
    steps.update()

    steps.set_postfix_str(f"init on {device}")
    model = init_random(LlavaForConditionalGeneration, build_config(spec, tokenizer), device, torch_dtype,
                        seed, gain)
    steps.update()

    steps.set_postfix_str("save weights")
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    steps.update()

    steps.set_postfix_str("processor")
    processor = LlavaProcessor(
        image_processor=_image_processor(spec), tokenizer=tokenizer, patch_size=spec.vision["patch_size"],
        vision_feature_select_strategy=spec.select_strategy,
        num_additional_image_tokens=1 if spec.vision_type == "clip" else 0,
        chat_template=spec.chat_template, image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(out)
    make_processor_configs_portable(out)  # so that every transformers version can load it
    finish_checkpoint(out, preset=preset, copies=spec.copies or None, seed=seed, gain=gain,
                      torch_dtype=torch_dtype, device=device, started=t0)
    steps.update()
    steps.close()
    return out


def _image_processor(spec: Preset):
    """CLIP's (shortest edge, then center crop) or SigLIP's (resize to a square, mean/std 0.5)."""
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    side = spec.image_size
    if spec.vision_type == "siglip":
        return SiglipImageProcessor(size={"height": side, "width": side}, resample=3,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                              image_mean=CLIP_MEAN, image_std=CLIP_STD)
