"""What the families' HF oracles share (common/families/<name>/oracle.py): each runs the family's
transformers class (ModelFamily.hf_class) on the same checkpoint in fp32, the reference the tests compare
our tokens, embeddings and positions with. The oracles import transformers only when one is made; no
service imports them."""

from __future__ import annotations

import hashlib

import torch
from PIL import Image


def image_identity(image: Image.Image) -> tuple:
    """A memo key for an image by its content: never id(), which a later image may reuse once this one
    is freed (an oracle keyed by id() once answered for the wrong image)."""
    return image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).hexdigest()


def greedy_new_tokens(model: torch.nn.Module, inputs: dict, n: int) -> list[int]:
    """The n tokens HF's greedy `generate` adds after the prompt of `inputs` (a batch of one)."""
    with torch.no_grad():
        seq = model.generate(**inputs, do_sample=False, max_new_tokens=n)
    return seq[0, inputs["input_ids"].shape[1]:].tolist()
