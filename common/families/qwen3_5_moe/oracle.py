"""The Qwen3.5-MoE oracle: Hugging Face's Qwen3_5MoeForConditionalGeneration on the same checkpoint (fp32,
CPU), built and run as Qwen3.5's (common/families/qwen3_5/oracle.py: its Gated DeltaNet layers on HF's
torch fallbacks)."""

from __future__ import annotations

from common.families.qwen3_5.oracle import IMAGE_PAD, Qwen3_5Oracle

__all__ = ["IMAGE_PAD", "Qwen3_5MoeOracle"]


class Qwen3_5MoeOracle(Qwen3_5Oracle):
    """greedy `generate` and `get_image_features` of HF's model (fp32, CPU)."""

    hf_class = "Qwen3_5MoeForConditionalGeneration"
