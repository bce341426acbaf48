"""Gemma 3's vision tower: SigLIP's last hidden state (after its post-LayerNorm, without the pooling
head), then Gemma3MultiModalProjector: the patch grid average-pooled to mm_tokens_per_image rows, Gemma's
(1 + w) RMSNorm, and a matmul with mm_input_projection_weight [vision hidden, text hidden].

This is `Gemma3ForConditionalGeneration.get_image_features` op for op (same reshapes, pooling, float32
norm and casts), so fp32 results equal HF's. The SigLIP transformer is transformers' own module, built on
the meta device and given only the checkpoint's vision tensors; the language model is never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

# transformers 5 saves "vision_tower.*" / "multi_modal_projector.*"; the Hub's checkpoints (written by
# transformers 4) say "vision_tower.vision_model.*"; a Gemma3Model-wrapped save adds "model.".
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised in float32, scaled by (1 + weight), cast back (Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    """[B, patches, vision hidden] -> [B, mm_tokens_per_image, text hidden] (Gemma3MultiModalProjector)."""

    def __init__(self, vision_hidden: int, text_hidden: int, image_size: int, patch_size: int,
                 tokens_per_image: int, eps: float) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
        self.patches_per_side = image_size // patch_size
        self.kernel = self.patches_per_side // int(tokens_per_image ** 0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, _, width = hidden.shape
        grid = hidden.transpose(1, 2).reshape(batch, width, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel, self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)  # row-major over the pooled grid, as HF
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(hidden)


class Gemma3VisionTower(nn.Module):
    """SigLIP (transformers' SiglipVisionModel) and the projector: pixels [B, 3, S, S] to image features."""

    def __init__(self, siglip: nn.Module, projector: Gemma3Projector) -> None:
        super().__init__()
        self.siglip = siglip
        self.projector = projector

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.siglip(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.projector(hidden)


def load_gemma3_tower(model_dir: str | Path, config: dict[str, Any], device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> Gemma3VisionTower:
    """The tower with the checkpoint's vision and projector tensors, strictly (config: config.json)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from common.checkpoint import load_tensors

    vision_cfg = SiglipVisionConfig(**{k: v for k, v in config["vision_config"].items() if k != "model_type"})
    text_hidden = int(config["text_config"]["hidden_size"])
    with torch.device("meta"):
        siglip = SiglipVisionModel(vision_cfg)
        projector = Gemma3Projector(vision_cfg.hidden_size, text_hidden, vision_cfg.image_size,
                                    vision_cfg.patch_size, int(config.get("mm_tokens_per_image", 256)),
                                    vision_cfg.layer_norm_eps)
    tower = Gemma3VisionTower(siglip, projector).to_empty(device="cpu")
    vision: dict[str, torch.Tensor] = {}
    proj: dict[str, torch.Tensor] = {}
    for name, tensor in load_tensors(model_dir, _VISION_PREFIXES + _PROJECTOR_PREFIXES).items():
        if name.startswith(_PROJECTOR_PREFIXES):
            proj[_strip(name, _PROJECTOR_PREFIXES)] = tensor
        else:
            vision[_strip(_strip(name, _VISION_PREFIXES), ("vision_model.",))] = tensor
    missing, unexpected = siglip.load_state_dict(vision, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]  # a non-persistent buffer
    if missing or unexpected:
        raise ValueError(f"{model_dir}: vision tower weights do not match: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    emb = siglip.embeddings  # to_empty left position_ids uninitialised: arange, as SigLIP builds it
    emb.position_ids.copy_(torch.arange(emb.num_positions).expand_as(emb.position_ids))
    projector.load_state_dict(proj, strict=True)
    return tower.to(device, dtype).eval()


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
