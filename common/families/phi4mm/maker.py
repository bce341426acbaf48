"""Random Phi-4-multimodal checkpoints in Hugging Face's format (Phi4MultimodalForCausalLM), offline.

- `phi-4-mm-tiny`: microsoft/Phi-4-multimodal-instruct's architecture at small widths, for CPU tests: the
  vision tower keeps the real 448 px crops and 14 px patches (the processor's token count assumes them:
  16 x 16 tokens per crop), at width 32 with 3 layers (feature_layer -2: 2 run); the text model is Phi-3's
  (fused qkv and gate_up, partial rotary 0.75, longrope factors, tied embeddings) at width 64; a one-block
  audio encoder (the checkpoint class always has one; no audio path is served).
- `phi-4-mm`: the real shapes (SigLIP-So400m at 448 px, 27 layers; a 3072-wide, 32-layer text model with
  200064 ids), random weights, for GPU figures.

The tokenizer is the shared byte-level BPE (common/model_maker.py) with Phi-4's chat and modality tokens
(`<|image|>` and `<|audio|>` as transformers' converted checkpoint names them, extra_special_tokens
image_token / audio_token, which Phi4MultimodalProcessor reads); ids are the tiny tokenizer's own. The
vision and speech LoRA adapters are written as the real checkpoint stores them (lora_weights.py: the
targeted modules' base weights under `.base_layer.`, `lora_A.vision` / `lora_B.vision` beside them,
config.json's `vision_lora` / `speech_lora`): random, large enough that image requests' greedy output
changes under the vision adapter. The tiny preset's ranks are small (vision 8, speech 4); `phi-4-mm`'s
are the real 256 and 320.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.families.phi4mm.lora_weights import REAL_LORA, TINY_LORA, add_lora_weights
from common.model_maker import (
    build_tokenizer,
    finish_checkpoint,
    init_random,
    pick_preset,
    prepare_output,
)

IMAGE_TOKEN, AUDIO_TOKEN, END_TOKEN = "<|image|>", "<|audio|>", "<|end|>"
PHI4_TOKENS = [IMAGE_TOKEN, AUDIO_TOKEN, END_TOKEN, "<|user|>", "<|assistant|>", "<|system|>"]
EOS_TOKEN = "<|endoftext|>"  # the shared tokenizer's "chatml" style has it: BOS, EOS and pad, as Phi-4's
TIED_EMBED_STD = 0.15  # tied embeddings are the output head too (common/model_maker's reason)

# Phi-4-MM's turn format: <|role|>content<|end|>, each image part as the processor's image token.
PHI4_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif content['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class Phi4Preset:
    """Shapes of one preset (fields not named are microsoft/Phi-4-multimodal-instruct's)."""

    name: str
    vision: dict
    text: dict
    vocab_size: int
    audio: dict = field(default_factory=dict)
    dynamic_hd: int = 36
    lora: dict = field(default_factory=lambda: REAL_LORA)  # {adapter: config.json's <adapter>_lora}
    copies: str = "microsoft/Phi-4-multimodal-instruct"


_TINY_AUDIO = dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                   ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32)

PHI4_PRESETS: dict[str, Phi4Preset] = {
    "phi-4-mm-tiny": Phi4Preset(
        name="phi-4-mm-tiny",
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
        vocab_size=512, audio=_TINY_AUDIO, dynamic_hd=16, lora=TINY_LORA,
    ),
    "phi-4-mm": Phi4Preset(
        name="phi-4-mm",
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16),
        text=dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                  num_key_value_heads=8),
        vocab_size=200064,
    ),
}


def build_phi4_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer of exactly vocab_size ids with Phi-4's turn and modality tokens."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(vocab_size - len(PHI4_TOKENS), seed, "chatml")
    raw = base.backend_tokenizer
    raw.add_special_tokens(PHI4_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        extra_special_tokens={"image_token": IMAGE_TOKEN, "audio_token": AUDIO_TOKEN},
        model_max_length=1 << 20, chat_template=PHI4_CHAT_TEMPLATE)


def build_phi4_config(preset: Phi4Preset, tokenizer):
    """The Phi4MultimodalConfig of a preset, token ids from the tokenizer: Phi-4-mini's longrope
    (partial rotary 0.75, one short and one long factor per rotated pair)."""
    from transformers import Phi4MultimodalConfig

    ids = tokenizer.convert_tokens_to_ids
    text = preset.text
    rotated_pairs = int(text["hidden_size"] // text["num_attention_heads"] * 0.75) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.01 * i for i in range(rotated_pairs)],
            "long_factor": [1.0 + 0.5 * i for i in range(rotated_pairs)],
            "original_max_position_embeddings": 4096}
    eos = [tokenizer.convert_tokens_to_ids(EOS_TOKEN), ids(END_TOKEN)]
    return Phi4MultimodalConfig(
        vocab_size=preset.vocab_size, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=eos[0], eos_token_id=eos, pad_token_id=eos[0], sliding_window=262144,
        vision_config=dict(image_size=448, patch_size=14, crop_size=448, feature_layer=-2,
                           image_token_id=ids(IMAGE_TOKEN), **preset.vision),
        audio_config=dict(audio_token_id=ids(AUDIO_TOKEN), **preset.audio),
        **text)


def _image_processor(preset: Phi4Preset):
    """An object carrying Phi4MultimodalImageProcessor's settings to save_pretrained: HF's own class
    imports torchvision, which the CPU installs lack, so a BaseImageProcessor named like it stands in;
    processor_config.json names HF's class, which loads wherever torchvision is installed."""
    from transformers.image_processing_utils import BaseImageProcessor

    cls = type("Phi4MultimodalImageProcessor", (BaseImageProcessor,),
               {"model_input_names": ["image_pixel_values", "image_sizes", "image_attention_mask"]})
    return cls(size={"height": 448, "width": 448}, patch_size=14, dynamic_hd=preset.dynamic_hd,
               image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_rescale=True,
               rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True, resample=3)


_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "fc2.weight")


@torch.no_grad()
def _scale(model: torch.nn.Module, seed: int, gain: float) -> None:
    """Redraw every weight at make-model's scale (common/model_maker._scale_init's rules; its config
    reading assumes a text_config, which Phi-4-MM's flat config has not): matrices N(0, gain/sqrt(fan_in)),
    residual writers over sqrt(depth), norms near one, small biases, the separators at unit scale. HF's own
    init draws the vision attention at std 1, which saturates every softmax."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    depth = {"vision": model.config.vision_config.num_hidden_layers, "text": model.config.num_hidden_layers}
    for name, param in model.named_parameters():
        shape = param.shape
        if name.endswith("embed_tokens.weight"):
            tmp = torch.normal(0.0, TIED_EMBED_STD, shape, generator=gen)
        elif param.dim() >= 2 and "extensor" not in name:
            fan_in = 1 if "embedding" in name and "patch" not in name else param[0].numel()
            std = gain / fan_in ** 0.5
            if name.endswith(_RESIDUAL_OUTPUTS):
                std /= depth["vision" if "img_processor" in name else "text"] ** 0.5
            tmp = torch.normal(0.0, std, shape, generator=gen)
        elif name.endswith("bias"):
            tmp = torch.normal(0.0, 0.02, shape, generator=gen)
        elif "norm" in name and "extensor" not in name:
            tmp = torch.normal(1.0, 0.1, shape, generator=gen)
        else:  # sub/global separators, the audio encoder's odd vectors
            tmp = torch.normal(0.0, 1.0, shape, generator=gen)
        param.copy_(tmp.to(param.device, param.dtype))


@torch.no_grad()
def _quiet_modality_tokens(model: torch.nn.Module, tokenizer) -> None:
    """Shrink the `<|image|>` and `<|audio|>` rows of the tied embeddings: as output rows they would
    otherwise win greedy steps of a random model after image-heavy prompts, and a generated image token
    is an input neither HF's model nor a server can embed (no pixels stand behind it). As inputs the rows
    are never read: the image and audio features replace them."""
    ids = tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, AUDIO_TOKEN])
    model.model.embed_tokens.weight[ids] *= 0.01


def make_phi4_model(preset: str, out: str | Path, seed: int = 0, device: str | None = None,
                    dtype: str | None = None, gain: float = 1.4, progress: bool = True,
                    vision_only: bool = False) -> Path:
    """Write a random Phi-4-multimodal checkpoint for `preset` (one of PHI4_PRESETS) into `out`."""
    from transformers import (
        Phi4MultimodalFeatureExtractor,
        Phi4MultimodalForCausalLM,
        Phi4MultimodalProcessor,
    )

    if vision_only:
        raise ValueError("weights='vision' is not offered for the Phi-4-MM presets; they are written whole")
    spec = pick_preset(PHI4_PRESETS, preset, "Phi-4-multimodal")
    out, device, torch_dtype = prepare_output(out, device, dtype,
                                              torch.float32 if preset.endswith("tiny") else torch.bfloat16)
    t0 = time.perf_counter()
    tokenizer = build_phi4_tokenizer(spec.vocab_size, seed)
    config = build_phi4_config(spec, tokenizer)
    model = init_random(Phi4MultimodalForCausalLM, config, device, torch_dtype, seed, gain, scale=_scale)
    _quiet_modality_tokens(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    add_lora_weights(out, spec.lora, seed)
    processor = Phi4MultimodalProcessor(image_processor=_image_processor(spec),
                                        audio_processor=Phi4MultimodalFeatureExtractor(), tokenizer=tokenizer,
                                        chat_template=PHI4_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    finish_checkpoint(out, preset=preset, copies=spec.copies, seed=seed, gain=gain, torch_dtype=torch_dtype,
                      device=device, started=t0)
    return out
