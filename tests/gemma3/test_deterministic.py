"""The deterministic mode on Gemma 3 (sliding-window layers, bidirectional image attention): the reference
request's tokens and logprobs are the same bits alone, among 7 others and after a prefix hit."""

from __future__ import annotations

from tests.deterministic_runs import assert_same_bits_in_company_and_after_a_prefix_hit

PROMPTS = ("<start_of_turn>user\na red car at night: <start_of_image> what is it, tell me<end_of_turn>\n"
           "<start_of_turn>model\n",
           "<start_of_turn>user\n<start_of_image> color?<end_of_turn>\n<start_of_turn>model\n",
           "<start_of_turn>user\nwrite a long story about a red car<end_of_turn>\n<start_of_turn>model\n")


def test_gemma3_same_bits(gemma3_tiny_dir):
    assert_same_bits_in_company_and_after_a_prefix_hit(gemma3_tiny_dir, PROMPTS)
