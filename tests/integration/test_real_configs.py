"""The LLaVA-family configurations people run, served through the pair, equal HF generate (fp32, greedy).

Each preset copies a real checkpoint's architecture fields at small widths: llava-1.5-7b-hf (CLIP-L/336,
576 image tokens, Llama), bakLlava-v1-hf (the same tower, Mistral with GQA and a sliding window) and
llava-interleave-qwen-0.5b-hf (SigLIP-384: 729 image tokens, no CLS row, "full"; Qwen2 with q/k/v biases
and tied embeddings). The interleave checkpoint is served by Hub id from a cache laid out as the Hub's,
with HF_HUB_OFFLINE=1, as a user who downloaded it would.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from common.families.llava.oracle import LlavaOracle
from tests.family_fixtures import made_checkpoint
from tests.hub_cache import lay_out_hub_cache
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import make_image

N = 12


@dataclass(frozen=True)
class Case:
    image_tokens: int
    text: str
    one_image: str
    two_images: str
    hub_id: str | None = None


_LLAVA = dict(text="USER: Tell me a story about a red car. ASSISTANT:",
              one_image="USER: <image>\nWhat is in this picture? ASSISTANT:",
              two_images="USER: <image>\n<image>\nWhich one is brighter? ASSISTANT:")
CASES = {
    "llava-1.5-tiny": Case(576, **_LLAVA),
    "bakllava-tiny": Case(576, **_LLAVA),
    "llava-interleave-qwen-tiny": Case(
        729, text="<|im_start|>user\nTell me a story about a red car.<|im_end|>\n<|im_start|>assistant\n",
        one_image="<|im_start|>user\n<image>\nWhat is in this picture?<|im_end|>\n<|im_start|>assistant\n",
        two_images="<|im_start|>user\n<image><image>\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n",
        hub_id="mmserve-test/llava-interleave-qwen-tiny"),
}


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    """(case, running pair, HF oracle) for one preset."""
    preset, case = request.param, CASES[request.param]
    model_dir = made_checkpoint(tmp_path_factory, preset, seed=0)
    model, env = model_dir, {}
    if case.hub_id:
        cache = tmp_path_factory.mktemp("hub")
        lay_out_hub_cache(model_dir, cache, case.hub_id)
        model, env = case.hub_id, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    pair = Pair(model, tmp_path_factory.mktemp(preset), env=env,
                decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "512",
                              "--encoder-timeout", "30"]).start()
    try:
        yield case, pair, LlavaOracle(model_dir)
    finally:
        pair.stop()


def test_prompts_with_zero_one_two_images_equal_hf(served):
    case, pair, oracle = served
    images = [make_image(21, (40, 52)), make_image(22, (300, 180))]  # two aspect ratios, one count
    jobs = [(case.text, []), (case.one_image, images[:1]), (case.two_images, images)]

    def run(job):
        prompt, imgs = job
        with pair.decoder_client(timeout=300) as client:
            return client.generate_text(prompt, [png(i) for i in imgs], max_tokens=N)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, imgs), result in zip(jobs, results, strict=True):
        inputs = oracle.processor(text=prompt, images=imgs or None)
        ids = list(inputs["input_ids"][0])
        assert ids.count(oracle.model.config.image_token_id) == case.image_tokens * len(imgs)
        assert result.usage.prompt_tokens == len(ids)  # the same image-token expansion as HF's
        assert result.usage.images == len(imgs)
        oracle.assert_same_tokens(result.token_ids, prompt, imgs, N)


def test_chat_template_equals_hf(served):
    case, pair, oracle = served
    image = make_image(23, (64, 48))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = oracle.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat = [{"role": "user", "content": [{"type": "image", "image": png(image)},
                                         {"type": "text", "text": "Describe it."}]}]
    with pair.decoder_client(timeout=300) as client:
        result = client.generate_text(chat=chat, max_tokens=N)
    oracle.assert_same_tokens(result.token_ids, prompt, [image], N)
