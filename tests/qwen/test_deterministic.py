"""The deterministic mode on Qwen2.5-VL and Qwen3-VL (M-RoPE, Qwen3's deepstack): the reference request's
tokens and logprobs are the same bits alone, among 7 others and after a prefix hit
(tests/engine/test_deterministic.py has the whole matrix on LLaVA)."""

from __future__ import annotations

from tests.deterministic_runs import QWEN_PROMPTS, assert_same_bits_in_company_and_after_a_prefix_hit


def test_qwen2_5_vl_same_bits(qwen_model_dir):
    assert_same_bits_in_company_and_after_a_prefix_hit(qwen_model_dir, QWEN_PROMPTS)


def test_qwen3_vl_same_bits(qwen3_model_dir):
    assert_same_bits_in_company_and_after_a_prefix_hit(qwen3_model_dir, QWEN_PROMPTS)
