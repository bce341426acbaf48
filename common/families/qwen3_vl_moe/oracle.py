"""The Qwen3-VL-MoE oracle: Hugging Face's Qwen3VLMoeForConditionalGeneration on the same checkpoint (fp32,
CPU), with Qwen3-VL's inputs and image features (common/families/qwen3_vl/oracle.py). On a CPU HF runs
its experts' eager loop (one product per expert hit, weighted outputs added expert by expert), the
reference decoder_svc/model/moe.py's torch path follows."""

from __future__ import annotations

from common.families.qwen3_vl.oracle import IMAGE_PAD, Qwen3Oracle

__all__ = ["IMAGE_PAD", "Qwen3MoeOracle"]


class Qwen3MoeOracle(Qwen3Oracle):
    """greedy `generate` and `get_image_features` of HF's Qwen3-VL-MoE model (fp32, CPU)."""

    hf_class = "Qwen3VLMoeForConditionalGeneration"
