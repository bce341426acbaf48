"""Gemma 3 with images through the in-process engine equals HF's Gemma3ForConditionalGeneration.generate
(fp32, CPU, gemma-3-tiny: 16 soft tokens per image, a 16-token sliding window): one image, two images,
an image first; prefill budgets that would split every image (an image is never split: it runs whole,
over the budget, or the chunk ends before it); a prefix-cache hit that ends inside an image; eight
concurrent requests with preemption, with synchronous and asynchronous scheduling.

HF attends bidirectionally among each image's soft tokens during prefill (token_type_ids); without the
key limits of decoder_svc/model/attention.py these tokens differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.gemma3.conftest import sample_images
from tests.oracle import greedy, run_all

N = 12
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
# Images near the prompt's end: the tiny model's sliding window is 16 tokens, and five of its six layers
# slide, so an image further back barely reaches the last token.
CASES = {"one": (TURN.format("a red car at night: <start_of_image>"), [0]),
         "two": (TURN.format("compare <start_of_image> with <start_of_image>"), [1, 2]),
         "first": ("<start_of_image>" + TURN.format("what?"), [3])}
TOP = 5  # logprobs compared at every step: closer than greedy tokens from a small random model


def make_engine(model_dir: Path, **overrides) -> LLMEngine:
    cfg = dict(model=model_dir, num_kv_blocks=128, max_num_batched_tokens=2048, block_size=16)
    cfg.update(overrides)
    config = EngineConfig(**cfg)
    return LLMEngine(config, LocalEmbeddingSource.for_engine(config))


@pytest.fixture(scope="module")
def images():
    return sample_images()


def hf_first_logprobs(oracle, prompt: str, imgs: list, bidirectional: bool = True) -> torch.Tensor:
    """HF's log-probabilities of the first new token (with or without the image block mask)."""
    inputs = oracle.inputs(prompt, imgs)
    if not bidirectional:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        return oracle.model(**inputs).logits[0, -1].float().log_softmax(-1)


@pytest.fixture(scope="module")
def want(gemma3_oracle, images) -> dict[str, tuple[list[int], torch.Tensor]]:
    """HF's greedy tokens and first-token logprobs for each case."""
    out = {}
    for name, (prompt, idx) in CASES.items():
        imgs = [images[i] for i in idx]
        out[name] = (gemma3_oracle.generate(prompt, imgs, N), hf_first_logprobs(gemma3_oracle, prompt, imgs))
    return out


def assert_same(out, want: tuple[list[int], torch.Tensor], name: str) -> None:
    """Same greedy tokens as HF, and the first token's top logprobs within fp32 rounding: HF's top values,
    and at each of our top ids HF's own logprob (two ids within the rounding of each other may swap
    places, as two near-tied ranks did once in a full run)."""
    tokens, logprobs = want
    assert not out.error and out.new_token_ids == tokens, name
    first = out.logprobs[0]
    mine = torch.tensor(first.top_logprobs)
    assert torch.allclose(mine, logprobs.topk(TOP).values, atol=2e-4), name
    assert torch.allclose(logprobs[first.top_ids], mine, atol=2e-4), name


def test_images_and_the_block_mask_change_hfs_output(gemma3_oracle, images, want) -> None:
    """The comparisons mean something: each case's first-token distribution moves with its images and
    with the bidirectional mask (HF without token_type_ids attends causally over the image)."""
    for name, (prompt, idx) in CASES.items():
        other = [images[(i + 1) % 4] for i in idx]
        assert (hf_first_logprobs(gemma3_oracle, prompt, other) - want[name][1]).abs().max() > 1e-3, name
        causal = hf_first_logprobs(gemma3_oracle, prompt, [images[i] for i in idx], bidirectional=False)
        assert (causal - want[name][1]).abs().max() > 1e-3, name
    assert len({t for tokens, _ in want.values() for t in tokens}) >= 6


def step_sizes(engine) -> list[int]:
    """The token count of every step the engine's runner executes from now on (appended as they run)."""
    seen: list[int] = []
    launch = engine.runner.execute

    def spy(batch):
        seen.append(batch.num_tokens)
        return launch(batch)

    engine.runner.execute = spy
    return seen


@pytest.mark.parametrize("budget", [2048, 20, 7])
def test_greedy_equals_hf_for_any_budget(gemma3_tiny_dir: Path, images, want, budget: int) -> None:
    """Budgets of 7 and 20 tokens would cut each 16-token image: chunks end before it, and an image
    larger than the budget runs whole as its step's prefill."""
    engine = make_engine(gemma3_tiny_dir, max_num_batched_tokens=budget)
    seen = step_sizes(engine)
    for name, (prompt, idx) in CASES.items():
        out = engine.generate(name, prompt, [images[i] for i in idx], sampling=greedy(N, logprobs=TOP))
        assert_same(out, want[name], name)
    assert max(seen) <= max(budget, 16)
    assert engine.stats().kv_blocks_used == 0


def test_prefix_hit_ending_inside_an_image(gemma3_tiny_dir: Path, gemma3_oracle, images) -> None:
    """A second request shares the first's start up to just after the image: the cached blocks end
    inside the image; the rest of it is computed attending to the whole image (cached and new keys)."""
    engine = make_engine(gemma3_tiny_dir, max_num_batched_tokens=2048)
    head = "<start_of_turn>user\nok <start_of_image>"
    first = head + "tell a long story about this<end_of_turn>\n<start_of_turn>model\n"
    second = head + "name two colours you see<end_of_turn>\n<start_of_turn>model\n"
    engine.generate("first", first, [images[0]], sampling=greedy(N))
    req = engine.inputs.make_request("second", second, [images[0]], sampling=greedy(N))
    span = req.images[0]
    out = engine.generate("second", second, [images[0]], sampling=greedy(N, logprobs=TOP))
    hit = out.usage.cached_prompt_tokens
    assert span.offset < hit < span.end, (span.offset, hit, span.end)
    assert_same(out, (gemma3_oracle.generate(second, [images[0]], N),
                      hf_first_logprobs(gemma3_oracle, second, [images[0]])), "second")


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_eight_concurrent_requests_with_preemption(gemma3_tiny_dir: Path, gemma3_oracle, images,
                                                   async_scheduling: str) -> None:
    engine = make_engine(gemma3_tiny_dir, num_kv_blocks=14, max_num_batched_tokens=24, max_num_seqs=4,
                         async_scheduling=async_scheduling)
    plan = {}
    for i in range(8):
        name = list(CASES)[i % 3]
        prompt, idx = CASES[name]
        imgs = [images[(j + i) % 4] for j in idx]
        plan[f"r{i}"] = (prompt, imgs)
        engine.add_request(f"r{i}", prompt, imgs, sampling=greedy(N))
    results = run_all(engine)
    assert engine.stats().preemptions > 0
    for rid, (prompt, imgs) in plan.items():
        assert results[rid]["tokens"] == gemma3_oracle.generate(prompt, imgs, N), rid
    assert engine.stats().kv_blocks_used == 0 and engine.scheduler.images.num_held == 0


def test_chat_messages_equal_hf_chat_template(gemma3_tiny_dir: Path, gemma3_oracle, images) -> None:
    """Image parts of a chat become `<start_of_image>` through the checkpoint's template; the ids equal
    HF's processor on the rendered text (its BOS from the template, none added), and so do the tokens."""
    from common.families.oracle import greedy_new_tokens

    messages = [{"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                             {"type": "text", "text": "with"}, {"type": "image"}]}]
    imgs = [images[1], images[2]]
    inputs = gemma3_oracle.chat_inputs(messages, imgs)
    want = greedy_new_tokens(gemma3_oracle.model, inputs, N)
    engine = make_engine(gemma3_tiny_dir)
    out = engine.generate("chat", None, imgs, messages=messages, sampling=greedy(N))
    assert out.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert out.new_token_ids == want
