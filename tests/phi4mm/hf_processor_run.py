"""Run Hugging Face's Phi4MultimodalProcessor (from a checkpoint) on tests/phi4mm/images.py's images and
save what it returns: `python -m tests.phi4mm.hf_processor_run MODEL_DIR OUT.pt`. Needs torchvision, or
tv_shim.py's stand-in first on sys.path (test_hf_processor.py runs it that way, in a subprocess)."""

from __future__ import annotations

import sys

import torch

# Images 1 and 2 of tests/phi4mm/images.sample_images, in order
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this, and"},
                                     {"type": "image"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "two images"},
        {"role": "user", "content": [{"type": "text", "text": "again"}]}]


def main(model_dir: str, out: str) -> None:
    from transformers import AutoProcessor

    from tests.phi4mm.images import sample_images

    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    images = sample_images()
    single = []
    for i, image in enumerate(images):
        prompt = f"<|user|>look {i}: {processor.image_token} and say<|end|><|assistant|>"
        enc = processor(text=prompt, images=[image], return_tensors="pt")
        single.append({"prompt": prompt, **{k: v for k, v in enc.items()}})
    # several images in one call: crops padded to the most any image has
    prompt = "<|user|>" + " then ".join(processor.image_token for _ in images[:3]) + "<|end|>"
    batch = dict(processor(text=prompt, images=images[:3], return_tensors="pt"))
    # a chat: the checkpoint's template (the tokenizer carries it; the tiny checkpoint's processor loads
    # without one) rendered, then the processor's expansion and tokenization, as apply_chat_template does
    text = processor.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat = {"text": text, **dict(processor(text=text, images=images[1:3], return_tensors="pt"))}
    counts = processor.image_processor(images=images, return_tensors="pt")["num_img_tokens"]
    extreme = None
    try:
        processor.image_processor(images=[thin_image()], return_tensors="pt")
    except ValueError as exc:
        extreme = str(exc)
    torch.save({"single": single, "batch": {"prompt": prompt, **batch}, "num_img_tokens": list(counts),
                "extreme": extreme, "chat": chat}, out)


def thin_image():  # noqa: N802 - a constructor-like helper
    """An image too thin for the processor (a side would shrink under 10 px)."""
    from PIL import Image

    return Image.new("RGB", (5000, 8), (9, 9, 9))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
