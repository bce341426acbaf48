"""The Hugging Face reference: the checkpoint family's transformers class (ModelFamily.hf_class, e.g.
LlavaForConditionalGeneration, Gemma3ForConditionalGeneration) and its generate, on the same checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from common.checkpoint import parse_dtype


def load_hf(model_dir: str | Path, device: str, dtype: str):
    """(model, processor) on device in dtype, offline: the model is the class of the checkpoint's family."""
    import transformers
    from transformers import AutoProcessor

    from common.families.registry import family_of_model

    cls = getattr(transformers, family_of_model(model_dir).hf_class)
    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = cls.from_pretrained(str(model_dir), dtype=parse_dtype(dtype), local_files_only=True)
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
