"""The Qwen3.5 oracle: Hugging Face's Qwen3_5ForConditionalGeneration on the same checkpoint (fp32, CPU).

Inputs are built as for Qwen3-VL (common/families/qwen3_vl/oracle.py, whose oracle this is with another
HF class and no DeepStack levels: the checkpoint's Qwen2-VL image processor and tokenizer, HF's processor
class needing torchvision). On a CPU without the `fla` and `causal-conv1d` kernels HF runs its torch
fallbacks of the Gated DeltaNet layers: the reference our layer (decoder_svc/model/gated_deltanet.py) is
checked against.
"""

from __future__ import annotations

import torch

from common.families.qwen3_vl.oracle import IMAGE_PAD, Qwen3Oracle

__all__ = ["IMAGE_PAD", "Qwen3_5Oracle"]


class Qwen3_5Oracle(Qwen3Oracle):
    """greedy `generate` and `get_image_features` of HF's model (fp32, CPU)."""

    hf_class = "Qwen3_5ForConditionalGeneration"

    def image_features(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
        """get_image_features of one batch as [rows_i, hidden] per image (the merged features: Qwen3.5 has
        no DeepStack levels)."""
        with torch.no_grad():
            out = self.model.get_image_features(pixel_values=pixel_values, image_grid_thw=grids)
        merged = out.pooler_output
        merged = merged if isinstance(merged, torch.Tensor) else torch.cat(list(merged))
        return list(merged.split([int(g.prod()) // self.merge**2 for g in grids]))
