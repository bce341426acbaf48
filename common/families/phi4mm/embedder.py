"""Phi-4-multimodal's image embedding: the tower's pooled crops laid out as the language model reads them.

Phi4MultimodalImageEmbedding (modeling_phi4_multimodal.py), in its "sub_glb" order, per image:

    sub-image:  the crops' 16 x 16 token grids tiled into (h_crops * 16) x (w_crops * 16), cut to the rows
                and columns the mask keeps (sampled at every other patch), each row followed by sub_GN
                (`sub_img_feature_extensor`)
    glb_GN      (`global_img_feature_extensor`), one row
    global:     the global view's 16 x 16 grid, each row followed by sub_GN

then the projector, Linear(vision hidden, text hidden), exact GELU, Linear(text hidden, text hidden): one
row per image token, in the order of the prompt's image tokens. Parameter names are HF's (under
`model.embed_tokens_extend.image_embed.`), so the checkpoint's tensors load as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.families.phi4mm.pixels import Phi4Pixels
from common.families.phi4mm.tower import Phi4VisionTower, layers_kept, tokens_side

IMAGE_EMBED_PREFIX = "model.embed_tokens_extend.image_embed."


class Phi4ImageEmbedder(nn.Module):
    """Images' crops to their image-token rows [tokens, text hidden], one tensor per image."""

    def __init__(self, vision: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        hidden = int(vision.get("hidden_size", 1152))
        image_size, patch = int(vision.get("image_size", 448)), int(vision.get("patch_size", 14))
        keep = layers_kept(int(vision.get("num_hidden_layers", 27)), int(vision.get("feature_layer", -2)))
        self.crop_size = int(vision.get("crop_size", 448))
        self.side = tokens_side(image_size, patch)
        self.img_processor = Phi4VisionTower(hidden, int(vision.get("intermediate_size", 4304)),
                                             int(vision.get("num_attention_heads", 16)), keep, image_size,
                                             patch, float(vision.get("layer_norm_eps", 1e-6)))
        self.img_projection_up = nn.Linear(hidden, text_hidden)
        self.img_projection_down = nn.Linear(text_hidden, text_hidden)
        self.global_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, hidden))
        self.sub_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, 1, hidden))

    def forward(self, images: Sequence[Phi4Pixels]) -> list[torch.Tensor]:
        """One [num_tokens, text hidden] tensor per image; every image's crops go through the tower in
        one batch (no padding crops: each image brings only its own)."""
        if not images:
            return []
        dtype = self.img_projection_up.weight.dtype
        device = self.img_projection_up.weight.device
        pixels = torch.cat([im.pixel_values for im in images]).to(device, dtype)
        masks = torch.cat([im.attention_mask for im in images]).to(device)
        feats = self.img_processor(pixels, masks)
        out, start = [], 0
        for im in images:
            n = im.pixel_values.shape[0]
            rows = self.layout(feats[start:start + n], im.attention_mask[1:].to(device), im.image_size)
            out.append(self.project(rows))
            start += n
        return out

    def layout(self, feats: torch.Tensor, crop_masks: torch.Tensor,
               image_size: tuple[int, int]) -> torch.Tensor:
        """[1 + crops, side^2, C] pooled features of one image to its rows [tokens, C] before projection."""
        side, c = self.side, feats.shape[-1]
        h_crops, w_crops = image_size[0] // self.crop_size, image_size[1] // self.crop_size
        sub_gn = self.sub_img_feature_extensor.reshape(1, 1, c)
        glb = feats[0].reshape(side, side, c)
        glb = torch.cat([glb, sub_gn.expand(side, 1, c)], dim=1).reshape(-1, c)
        sub = (feats[1:1 + h_crops * w_crops].reshape(h_crops, w_crops, side, side, c).transpose(1, 2)
               .reshape(h_crops * side, w_crops * side, c))
        kept = (crop_masks[:h_crops * w_crops, 0::2, 0::2].reshape(h_crops, w_crops, side, side)
                .transpose(1, 2).reshape(h_crops * side, w_crops * side))
        useful_h, useful_w = int(kept[:, 0].sum().item()), int(kept[0, :].sum().item())
        sub = sub[:useful_h, :useful_w]
        sub = torch.cat([sub, sub_gn.expand(useful_h, 1, c)], dim=1).reshape(-1, c)
        return torch.cat([sub, self.global_img_feature_extensor.reshape(1, c), glb])

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """The projector: up, exact GELU, down."""
        return self.img_projection_down(nn.functional.gelu(self.img_projection_up(rows)))


def load_phi4_embedder(model_dir: str | Path, config: dict[str, Any], device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> Phi4ImageEmbedder:
    """The embedder with the checkpoint's image-embedding tensors (the layers past feature_layer, the
    post-LayerNorm and the pooling head are left on disk), strictly otherwise."""
    from common.checkpoint import load_tensors

    with torch.device("meta"):
        embedder = Phi4ImageEmbedder(config["vision_config"], int(config["hidden_size"]))
    embedder = embedder.to_empty(device="cpu")
    wanted = set(embedder.state_dict())
    tensors = {name[len(IMAGE_EMBED_PREFIX):]: t
               for name, t in load_tensors(model_dir, (IMAGE_EMBED_PREFIX,)).items()}
    state = {k: v for k, v in tensors.items() if k in wanted}
    missing = sorted(wanted - set(state))
    if missing:
        raise ValueError(f"{model_dir}: image embedding weights missing: {missing[:5]}")
    embedder.load_state_dict(state, strict=True)
    for layer in embedder.img_processor.encoder.layers:
        layer.fuse_qkv()
    return embedder.to(device, dtype).eval()
