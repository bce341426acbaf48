"""The Phi-4-multimodal oracle: Hugging Face's Phi4MultimodalForCausalLM on the same checkpoint (fp32, CPU).

The checkpoint stores its LoRA-wrapped modules' weights under `.base_layer.` beside the adapters
(lora_weights.py), which HF's class (no LoRA modules) does not read: the oracle loads them itself, as the
base weights (`base`: text requests) and with the vision adapter merged in (`vision`: image requests, as
the served model runs them), each a Phi4MultimodalForCausalLM; generate picks by the request's images.

Pixel inputs are pixels.py's (HF's image processor needs torchvision; bench/phi4mm_pixels_check.py checks
that the two agree where it is installed), prompts are expanded by Phi4MultimodalProcessor's rule (each
image token repeated num_img_tokens times).

The vision model runs with eager attention: under SDPA, HF's Phi4MultimodalVisionAttention (is_causal =
True) turns causal whenever its batch has no padded crop (its mask is then None and sdpa_attention_forward
falls back to the module's is_causal), so an image's features would depend on the other images of its
batch. Eager attention is bidirectional always, as the original model's SigLIP is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from common.families.oracle import greedy_new_tokens
from common.families.phi4mm.layout import VISION_ADAPTER, Phi4ImageLayout
from common.families.phi4mm.lora_weights import merged_language_state
from common.families.phi4mm.pixels import batch_pixels, hd_transform


def load_hf_model(model_dir: str | Path, adapter: str | None = None):
    """HF's Phi4MultimodalForCausalLM on the checkpoint in fp32, its LoRA-wrapped modules' weights read from
    `.base_layer.` with `adapter` merged in (None: the base model)."""
    import transformers
    from transformers import Phi4MultimodalForCausalLM

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the base_layer names it cannot place: loaded below
    try:
        model = Phi4MultimodalForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    state = merged_language_state(model_dir, adapter)
    params = dict(model.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing or not state:
        raise ValueError(f"LoRA-wrapped weights HF's model does not have: {missing[:3]} (of {len(state)})")
    with torch.no_grad():
        for name, w in state.items():
            params[name].copy_(w)
    model.model.embed_tokens_extend.image_embed.img_processor.config._attn_implementation = "eager"
    return model


class Phi4Oracle:
    """HF's image embedding (what the model writes at the image tokens) and greedy `generate`: the base
    model for text, the vision adapter merged in for requests with images."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from common.checkpoint import load_config

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.layout = Phi4ImageLayout.from_checkpoint(model_dir, load_config(model_dir))
        self.base = load_hf_model(model_dir)
        self.vision = load_hf_model(model_dir, VISION_ADAPTER)
        self.model = self.base  # image features: the tower is the same in both
        self.image_token_id = self.model.config.vision_config.image_token_id

    def model_for(self, images: list, adapter: str | None = "auto"):
        """The model a request runs on: "auto" picks by its images (vision adapter with images), None is
        the base model, "vision" the adapted one."""
        if adapter == "auto":
            adapter = VISION_ADAPTER if images else None
        return self.vision if adapter == VISION_ADAPTER else self.base

    def pixels(self, images: list[Image.Image]) -> dict:
        """The processor's image outputs for images (image_pixel_values, image_sizes, image_attention_mask,
        num_img_tokens)."""
        return batch_pixels([hd_transform(im, self.layout.settings) for im in images])

    def inputs(self, prompt: str, images: list[Image.Image]) -> dict:
        """Model inputs for a prompt whose image tokens stand for images, in order."""
        out: dict = {}
        counts: list[int] = []
        if images:
            px = self.pixels(images)
            counts = px.pop("num_img_tokens")
            out.update(px)
        enc = self.tokenizer(self.layout.expand_prompt(prompt, counts), return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], **out}

    def image_features(self, images: list[Image.Image] | dict) -> list[torch.Tensor]:
        """HF's Phi4MultimodalImageEmbedding over images (or the processor outputs of them, batched): the
        rows it writes at each image's tokens, [num_img_tokens, hidden] per image."""
        px = dict(images) if isinstance(images, dict) else self.pixels(images)
        counts = list(px.pop("num_img_tokens"))
        ids = torch.full((1, sum(counts)), self.image_token_id)
        embed = self.model.model.embed_tokens_extend.image_embed
        with torch.no_grad():
            rows = embed(ids, torch.zeros(1, sum(counts), self.model.config.hidden_size),
                         image_pixel_values=px["image_pixel_values"], image_sizes=px["image_sizes"],
                         image_attention_mask=px["image_attention_mask"])[0]
        return list(rows.split(counts))

    def generate(self, prompt: str, images: list[Image.Image], n: int, adapter: str | None = "auto"
                 ) -> list[int]:
        """HF's greedy new tokens (adapter: model_for's)."""
        return greedy_new_tokens(self.model_for(images, adapter), self.inputs(prompt, images), n)

    def first_logprobs(self, prompt: str, images: list[Image.Image]) -> torch.Tensor:
        """The log-probabilities of the first new token (the model model_for picks)."""
        with torch.no_grad():
            logits = self.model_for(images)(**self.inputs(prompt, images)).logits[0, -1]
        return logits.log_softmax(-1)


class Phi4ProcessorReproduction:
    """Phi4MultimodalImageProcessor's outputs (pixel values, masks, sizes, token counts) from pixels.py,
    for hosts without torchvision: what the CPU oracle feeds HF's model (bench/phi4mm_pixels_check.py
    checks the two agree where torchvision is installed)."""

    def __init__(self, model_dir: str | Path) -> None:
        from common.checkpoint import load_config

        self.settings = Phi4ImageLayout.from_checkpoint(model_dir, load_config(model_dir)).settings

    def __call__(self, images: list[Image.Image], return_tensors: str = "pt") -> dict:
        """HF's processor call: a batch of PIL images to its output dict."""
        return batch_pixels([hd_transform(im, self.settings) for im in images])
