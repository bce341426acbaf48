"""Random checkpoints in Hugging Face format, offline: `mmserve make-model --preset NAME --out DIR`.

`make_model` hands a preset to its family's maker (common/families/<name>/maker.py, found through the
registry); this module holds what the makers share: a byte-level BPE tokenizer trained locally, weights
drawn at a scale where a random model's greedy output varies (a model at the usual 0.02 init repeats one
token forever, which makes parity tests against Hugging Face prove little), the vision-only variant for
shapes too large to write, and portable processor class names. It imports no family's maker.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch

PresetT = TypeVar("PresetT")

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
# A ChatML tokenizer (Qwen2's): no BOS, ChatML turn markers, <|endoftext|> pads.
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN]

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def preset_names() -> list[str]:
    """Every preset make_model knows, family by family (common/families/registry.py)."""
    from common.families import preset_names as every_preset

    return every_preset()


def _corpus(seed: int, n_lines: int) -> list[str]:
    """A deterministic synthetic corpus for training the tokenizer (no downloads)."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st",
              "tr", "ch", "sh", "th", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "st"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    common = ("the image shows a of and in on with what is this picture describe USER ASSISTANT "
              "cat dog red blue green car tree sky person table \n").split(" ")
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            if rng.random() < 0.35:
                words.append(rng.choice(common))
            else:
                words.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
        sep = rng.choice([" ", " ", ", ", ". ", "? ", "\n"])
        lines.append(sep.join(words) + rng.choice([".", "?", "!", ":", ""]) + str(rng.randint(0, 99)))
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0, style: str = "llama"):
    """A byte-level BPE tokenizer padded to exactly vocab_size ids, with LLaVA's special tokens and BOS
    (style "llama") or ChatML tokens and no BOS (style "chatml", Qwen2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=CHATML_SPECIAL_TOKENS if style == "chatml" else SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed, min(200_000, 40 * vocab_size)), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # a small corpus can run out of merges: fill the rest so every logit is a token
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    if style == "chatml":
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            extra_special_tokens={"image_token": IMAGE_TOKEN}, model_max_length=1 << 20)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=1 << 20,
    )


_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "fc2.weight")
_TEXT_QKV_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")
_TIED_EMBED_STD = 0.15


@torch.no_grad()
def _scale_init(model: torch.nn.Module, seed: int, gain: float) -> None:
    """Redraw every weight at a scale where activations neither vanish nor saturate.

    Matrices get N(0, gain / sqrt(fan_in)) so each layer's update is as large as its input; norms stay
    at one with a little jitter; embeddings get unit variance. This makes greedy output vary from token
    to token, unlike the usual std=0.02 init.
    """
    device = next(p for p in model.parameters() if not p.is_meta).device
    gen = torch.Generator(device=device).manual_seed(seed)
    config = model.config
    vision = config.vision_config  # Qwen's vision config says depth (older transformers map no alias)
    depth = {"vision": getattr(vision, "num_hidden_layers", None) or vision.depth,
             "text": config.text_config.num_hidden_layers}
    tied = bool(config.text_config.tie_word_embeddings)
    for name, param in model.named_parameters():
        if param.is_meta:  # a part left unmade (init_vision_only's language model)
            continue
        tmp = torch.empty(param.shape, dtype=torch.float32, device=device)
        if param.dim() >= 2 and name.endswith("embed_tokens.weight") and tied:
            # Tied embeddings are also the output head: at unit scale each token's logit is dominated by
            # its own input embedding, and greedy decoding repeats the last token forever.
            tmp.normal_(0.0, _TIED_EMBED_STD, generator=gen)
        elif param.dim() >= 2:
            fan_in = param.shape[1] if "embed" not in name else 1
            if "patch_embed" in name:  # conv patch embeddings: fan-in is one whole kernel
                fan_in = param[0].numel()
            std = gain / fan_in**0.5
            if name.endswith(_RESIDUAL_OUTPUTS):
                # Layers that write into the residual stream are scaled by 1/sqrt(depth) so the sum of
                # all layers stays comparable to the token embedding: deep random models otherwise lose
                # the token's identity and fall into repeating one token.
                std /= depth["vision" if "vision_tower" in name else "text"] ** 0.5
            tmp.normal_(0.0, std, generator=gen)
        elif name.endswith(_TEXT_QKV_BIASES) and "language_model" in name:
            # Qwen2's q/k/v biases: large enough that a decoder which dropped them would differ.
            tmp.normal_(0.0, 0.5, generator=gen)
        elif name.endswith("bias"):
            tmp.normal_(0.0, 0.02, generator=gen)
        else:  # norm weights, class embedding
            tmp.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 1.0, generator=gen)
        param.copy_(tmp.to(param.dtype))


def init_random(model_cls, config, device: str, dtype: torch.dtype, seed: int, gain: float,
                scale=None):
    """model_cls(config) made directly on device in dtype, its weights redrawn by `scale(model, seed,
    gain)` (default _scale_init; a family whose config _scale_init cannot read brings its own)."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(old_dtype)
    (scale or _scale_init)(model, seed, gain)
    model.config.dtype = dtype
    return model


def is_language_weight(name: str) -> bool:
    """A parameter of the language model (HF's names in transformers 5: model.language_model.*, lm_head)."""
    return name.startswith(("model.language_model.", "lm_head."))


def init_vision_only(model_cls, config, device: str, dtype: torch.dtype, seed: int, gain: float):
    """model_cls(config) with only its vision side made (on device, in dtype, at make-model's scale); the
    language model stays on the meta device, taking no memory: for shapes too large to write."""
    with torch.device("meta"):
        model = model_cls(config)
    for prefix, module in model.named_modules():
        for key, param in list(module._parameters.items()):
            if param is not None and not is_language_weight(f"{prefix}.{key}" if prefix else key):
                module._parameters[key] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False)
    _scale_init(model, seed, gain)
    model.config.dtype = dtype
    return model


def make_model(
    preset: str,
    out: str | Path,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    gain: float = 1.4,
    progress: bool = True,
    weights: str = "all",
) -> Path:
    """Write a random checkpoint for `preset` into `out` and return its path: the preset's family's
    maker (common/families/<name>/maker.py, through the registry).

    device defaults to CUDA when there is one (the 7B preset initialises in seconds there, minutes
    on a CPU); dtype defaults to float32 for tiny/small and bfloat16 for the 7B shapes.
    """
    from common.families import family_for_preset

    if weights not in ("all", "vision"):
        raise ValueError(f"weights must be 'all' or 'vision', not {weights!r}")
    family = family_for_preset(preset)  # ValueError naming every preset for an unknown one
    return family.make_model(preset, out, seed, device, dtype, gain, progress, weights == "vision")


def portable_class_names(data: dict) -> None:
    """Name every image processor class in a processor config by its portable name (no Pil/Fast
    suffix), so that every transformers version can load it."""
    for key, value in list(data.items()):
        if isinstance(value, dict):
            portable_class_names(value)
        elif key == "image_processor_type" and isinstance(value, str):
            data[key] = value.removesuffix("Pil").removesuffix("Fast")


def pick_preset(presets: Mapping[str, PresetT], preset: str, family: str) -> PresetT:
    """presets[preset]; ValueError naming the family's presets for a name it does not have."""
    if preset not in presets:
        raise ValueError(f"unknown {family} preset {preset!r}; choose one of {', '.join(presets)}")
    return presets[preset]


def prepare_output(out: str | Path, device: str | None, dtype: str | None,
                   default_dtype: torch.dtype) -> tuple[Path, str, torch.dtype]:
    """A maker's (checkpoint folder, device, torch dtype): the folder made, the device CUDA when there is
    one unless named, the dtype named or the preset's default."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = getattr(torch, dtype) if dtype else default_dtype
    return out, device, torch_dtype


def make_processor_configs_portable(out: Path) -> None:
    """Rewrite the processor configs save_pretrained wrote with portable class names."""
    for cfg_name in ("preprocessor_config.json", "processor_config.json"):
        path = out / cfg_name
        if path.exists():
            data = json.loads(path.read_text())
            portable_class_names(data)
            path.write_text(json.dumps(data, indent=2) + "\n")


def write_preprocessor_config(out: Path, data: dict) -> None:
    """A copy of data, its class names made portable, as out/preprocessor_config.json."""
    data = json.loads(json.dumps(data))  # a deep copy: callers pass module constants
    portable_class_names(data)
    (out / "preprocessor_config.json").write_text(json.dumps(data, indent=2) + "\n")


def finish_checkpoint(out: Path, *, preset: str, copies: str | None, seed: int, gain: float,
                      torch_dtype: torch.dtype, device: str, started: float,
                      language_weights: bool | None = None) -> None:
    """Make every file of the checkpoint readable to all and write its mmserve_model.json (how it was
    made; language_weights only where a maker can leave them out). started: time.perf_counter() at the
    start."""
    for path in out.iterdir():  # save_pretrained writes weights 0600
        if path.is_file():
            path.chmod(0o644)
    meta = {"preset": preset, "copies": copies, "random_weights": True}
    if language_weights is not None:
        meta["language_weights"] = language_weights
    meta |= {"seed": seed, "gain": gain, "dtype": str(torch_dtype).removeprefix("torch."), "made_on": device,
             "seconds": round(time.perf_counter() - started, 2)}
    (out / "mmserve_model.json").write_text(json.dumps(meta, indent=2) + "\n")
