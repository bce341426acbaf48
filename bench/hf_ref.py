"""The Hugging Face reference: the checkpoint family's transformers class (ModelFamily.hf_class, e.g.
LlavaForConditionalGeneration, Gemma3ForConditionalGeneration) and its generate, on the same checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common.checkpoint import parse_dtype


def load_hf(model_dir: str | Path, device: str, dtype: str):
    """(model, processor) on device in dtype, offline: the model is the class of the checkpoint's family."""
    import transformers
    from transformers import AutoProcessor, AutoTokenizer

    from common.families.registry import family_of_model

    cls = getattr(transformers, family_of_model(model_dir).hf_class)
    try:
        processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except (ImportError, ValueError) as exc:  # e.g. Phi-4's image processor needs torchvision: text only
        print(f"HF processor unavailable ({str(exc).splitlines()[0][:120]}): its tokenizer only", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        processor = SimpleNamespace(tokenizer=tokenizer)
    placement = {"device_map": device} if torch.device(device).type == "cuda" else {}  # see bench.ttft
    model = cls.from_pretrained(str(model_dir), dtype=parse_dtype(dtype), local_files_only=True, **placement)
    model = model.to(device).eval()
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # decoder-only batching
    return model, processor


def timed_generate(model, inputs: dict, new_tokens: int) -> tuple[float, int]:
    """(seconds, generated tokens) of one greedy generate of exactly new_tokens per row (EOS ignored)."""
    device = next(model.parameters()).device
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.text_config.eos_token_id if hasattr(model.config, "text_config") else 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    rows, total = out.shape[0], out.shape[1] - inputs["input_ids"].shape[1]
    return seconds, rows * total


def text_inputs(processor, prompt: str, batch: int, device: str) -> dict:
    """input_ids/attention_mask for `batch` copies of a text-only prompt."""
    enc = processor.tokenizer([prompt] * batch, return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


def image_inputs(model, processor, prompts: list[str], images: list, device: str) -> dict:
    """Padded batch of prompts with one image each (PIL images), pixel values in the model's dtype."""
    inputs = processor(text=prompts, images=images, return_tensors="pt", padding=True).to(device)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    return dict(inputs)


def hf_image_processor(model_dir: str | Path):
    """The checkpoint's HF image processor (called as processor(images=[...], return_tensors="pt")). Where
    it cannot load on this host (Phi-4-multimodal's needs torchvision, which CPU hosts lack), the family's
    reproduction of it (`ModelFamily.processor_stand_in`, what its CPU oracle uses), so that a CPU smoke
    run goes through the HF reference too."""
    from common.families.registry import family_of_model
    from common.vision.image_processor import load_image_processor

    try:
        return load_image_processor(Path(model_dir))
    except (ImportError, ValueError):
        family = family_of_model(model_dir)
        if family.processor_stand_in is None:
            raise
    return family.image_processor_stand_in(model_dir)


def hf_image_features(model, pixels: dict, device: torch.device, dtype: torch.dtype,
                      feature_kw: dict | None = None) -> torch.Tensor:
    """HF's image embedding of a processor's outputs: get_image_features(pixel_values), or for
    Phi-4-multimodal's HD crops (image_pixel_values) its image embedding module over as many image
    tokens as the processor counted."""
    if "image_pixel_values" not in pixels:
        return model.get_image_features(pixel_values=pixels["pixel_values"].to(device, dtype),
                                        **(feature_kw or {}))
    total = int(sum(pixels["num_img_tokens"]))
    ids = torch.full((1, total), model.config.vision_config.image_token_id, device=device)
    hidden = torch.zeros(1, total, model.config.hidden_size, device=device, dtype=dtype)
    return model.model.embed_tokens_extend.image_embed(
        ids, hidden, image_pixel_values=pixels["image_pixel_values"].to(device, dtype),
        image_sizes=pixels["image_sizes"].to(device),
        image_attention_mask=pixels["image_attention_mask"].to(device, dtype))
