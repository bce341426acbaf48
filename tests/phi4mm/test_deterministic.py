"""The deterministic mode on Phi-4-multimodal (its vision adapter runs on image requests, so a batch mixes
adapter and base rows): the reference request's tokens and logprobs are the same bits alone, among 7 others
and after a prefix hit."""

from __future__ import annotations

from tests.deterministic_runs import assert_same_bits_in_company_and_after_a_prefix_hit

PROMPTS = ("<|user|><|image|>what is in the picture? tell me more<|end|><|assistant|>",
           "<|user|><|image|>color?<|end|><|assistant|>",
           "<|user|>tell a story about the lighthouse<|end|><|assistant|>")


def test_phi4mm_same_bits(phi4_tiny_dir):
    assert_same_bits_in_company_and_after_a_prefix_hit(phi4_tiny_dir, PROMPTS)
