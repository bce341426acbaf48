"""Random Gemma 3 checkpoints in Hugging Face format, offline: the `gemma-3-tiny` preset.

`gemma-3-tiny` copies the architecture choices of `google/gemma-3-4b-it` (transformers' Gemma3Config and
Gemma3TextConfig defaults, which are that checkpoint's, plus its config.json's overrides as published)
at small widths, so that it runs on a CPU in seconds:

- vision: a SigLIP tower without its pooling head (tanh GELU, LayerNorm eps 1e-6, 14-px patches) whose
  patch grid is average-pooled 4x4 into `mm_tokens_per_image` tokens (4b: 896 px, 64x64 patches, 256
  tokens; here 224 px, 16x16 patches, 16 tokens), then Gemma's (1 + w) RMSNorm and a projection;
- text: GeGLU, QK-norm, (1 + w) RMSNorms before and after attention and feed-forward, embeddings scaled
  by sqrt(hidden), tied output head, five sliding-window layers to one global layer (4b: 34 layers,
  window 1024; here 6 layers, window 16), local rope base 1e4, global 1e6 with linear scaling 8,
  query_pre_attn_scalar = head_dim, GQA 2:1;
- processor: 0.5 mean/std, bilinear resize to a square, `<start_of_image>` as the prompt's marker,
  expanded by Gemma3Processor to `\\n\\n<start_of_image>` + soft tokens + `<end_of_image>\\n\\n`;
  pan-and-scan off as the 4b's, or on with the settings `pan_and_scan` gives (a small min_crop_size makes
  small test images crop: tests/gemma3's pan-and-scan checkpoint).

Vocabulary ids are the tiny tokenizer's own; the chat template is Gemma 3's turn format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.families.gemma3.layout import PanAndScan
from common.model_maker import (
    build_tokenizer,
    finish_checkpoint,
    init_random,
    make_processor_configs_portable,
    pick_preset,
    prepare_output,
)

BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TIED_EMBED_STD = 0.05  # x sqrt(64) = 0.4 in the residual: the layers' unit-RMS (post-normed) outputs lead
GEMMA_TOKENS = ["<start_of_turn>", "<end_of_turn>", BOI_TOKEN, EOI_TOKEN, IMAGE_SOFT_TOKEN]

# Gemma 3's chat template: BOS, a system turn folded into the first user turn, "model" for the
# assistant's role, each image part written as <start_of_image> (the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class GemmaPreset:
    """Shapes of one Gemma 3 preset (fields not named here are google/gemma-3-4b-it's)."""

    name: str
    vision: dict
    text: dict
    image_size: int
    mm_tokens_per_image: int
    vocab_size: int
    copies: str = "google/gemma-3-4b-it"


_SIGLIP_896 = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                   patch_size=14)

GEMMA3_PRESETS: dict[str, GemmaPreset] = {
    "gemma-3-tiny": GemmaPreset(
        name="gemma-3-tiny",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    patch_size=14),
        # 6 layers: the 4b's 5 local : 1 global pattern once; a 16-token window so prompts outgrow it.
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                  max_position_embeddings=131072),
        image_size=224, mm_tokens_per_image=16, vocab_size=512,
    ),
    # The real shapes (google/gemma-3-4b-it, -12b-it: SigLIP-So400m at 896 px, 256 tokens per image), for
    # GPU figures; random weights.
    "gemma-3-4b": GemmaPreset(
        name="gemma-3-4b", vision=_SIGLIP_896,
        text=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                  max_position_embeddings=131072),
        image_size=896, mm_tokens_per_image=256, vocab_size=262208,
    ),
    "gemma-3-12b": GemmaPreset(
        name="gemma-3-12b", vision=_SIGLIP_896,
        text=dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                  max_position_embeddings=131072),
        image_size=896, mm_tokens_per_image=256, vocab_size=262208, copies="google/gemma-3-12b-it",
    ),
}


def build_gemma3_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of exactly vocab_size ids with Gemma 3's turn and image tokens, named
    as Gemma3Processor reads them (boi_token, eoi_token, image_token and their ids)."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(vocab_size - len(GEMMA_TOKENS), seed, "llama")
    raw = base.backend_tokenizer
    raw.add_special_tokens(GEMMA_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN,
                              "image_token": IMAGE_SOFT_TOKEN},
        model_max_length=1 << 20, chat_template=GEMMA3_CHAT_TEMPLATE)


def build_gemma3_config(preset: GemmaPreset, tokenizer):
    """The Gemma3Config of a preset, token ids from the tokenizer."""
    from transformers import Gemma3Config

    ids = tokenizer.convert_tokens_to_ids
    text = dict(vocab_size=preset.vocab_size, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, **preset.text)
    vision = dict(model_type="siglip_vision_model", image_size=preset.image_size,
                  hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False, **preset.vision)
    return Gemma3Config(text_config=text, vision_config=vision,
                        mm_tokens_per_image=preset.mm_tokens_per_image,
                        boi_token_index=ids(BOI_TOKEN), eoi_token_index=ids(EOI_TOKEN),
                        image_token_index=ids(IMAGE_SOFT_TOKEN), tie_word_embeddings=True,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)


@torch.no_grad()
def _gemma_scale(model: torch.nn.Module, seed: int, gain: float) -> None:
    """Fix what make-model's shared init (common/model_maker._scale_init) gets wrong for Gemma: its (1 + w)
    RMSNorms would scale by 2 at the shared N(1, 0.1) (Gemma's weights are centred on 0); the projector's
    matrix is [in, out] (x @ W), so its fan-in is dim 0, not dim 1; and the tied embeddings are multiplied
    by sqrt(hidden) on the way in, so at the shared std each token's own embedding dominates the residual
    and greedy decoding repeats the prompt's last token from the first step (seen on gemma-3-tiny)."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    for module in model.modules():
        if type(module).__name__ == "Gemma3RMSNorm":
            w = module.weight
            w.copy_(torch.normal(0.0, 0.1, w.shape, generator=gen).to(w))
    embed = model.model.language_model.embed_tokens.weight
    embed.copy_(torch.normal(0.0, TIED_EMBED_STD, embed.shape, generator=gen).to(embed))
    proj = model.model.multi_modal_projector.mm_input_projection_weight
    proj.copy_(torch.normal(0.0, gain / proj.shape[0] ** 0.5, proj.shape, generator=gen).to(proj))


def make_gemma3_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                      dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                      vision_only: bool = False, pan_and_scan: PanAndScan | None = None) -> Path:
    """Write a random Gemma 3 checkpoint for `preset` (one of GEMMA3_PRESETS) into `out`; its path. With
    `pan_and_scan`, its image processor config turns crops on with those settings (the weights and
    config.json are the same as without)."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor

    if vision_only:
        raise ValueError("weights='vision' is not offered for the Gemma 3 presets; they are written whole")
    spec = pick_preset(GEMMA3_PRESETS, preset, "Gemma 3")
    out, device, torch_dtype = prepare_output(out, device, dtype, torch.float32)
    t0 = time.perf_counter()
    tokenizer = build_gemma3_tokenizer(spec.vocab_size, seed)
    model = init_random(Gemma3ForConditionalGeneration, build_gemma3_config(spec, tokenizer), device,
                        torch_dtype, seed, gain)
    _gemma_scale(model, seed, gain)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    processor = Gemma3Processor(image_processor=_image_processor(spec, pan_and_scan), tokenizer=tokenizer,
                                chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=spec.mm_tokens_per_image)
    processor.save_pretrained(out)
    make_processor_configs_portable(out)
    finish_checkpoint(out, preset=preset, copies=spec.copies, seed=seed, gain=gain, torch_dtype=torch_dtype,
                      device=device, started=t0)
    return out


def _image_processor(spec: GemmaPreset, pan_and_scan: PanAndScan | None = None):
    """google/gemma-3-4b-it's image processor at the preset's size: bilinear resize to a square, 0.5
    mean/std, pan-and-scan off (its config leaves it null) unless `pan_and_scan` is given."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    side = spec.image_size
    crops = pan_and_scan.processor_kwargs() if pan_and_scan is not None else {}
    return Gemma3ImageProcessorPil(size={"height": side, "width": side}, resample=2,
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                   rescale_factor=1 / 255, **crops)
