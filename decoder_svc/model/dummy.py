"""`--load-format dummy`: random weights made on the device from config.json alone, no weight files.

For benchmarks of shapes nobody wants to write to disk (7B to 72B). The draw follows make-model's rule
(common/model_maker.py) so greedy output varies as a real model's does, and decode lengths, acceptance
of stop tokens and the FP8 accuracy measurements behave like a trained model's rather than repeating one
token: matrices N(0, gain / sqrt(fan_in)), the layers writing into the residual stream further divided
by sqrt(layers), norms near one, embeddings of unit variance (0.15 when tied to the output head).
"""

from __future__ import annotations

import zlib

import torch

# (a MoE layer's stacked experts, [experts, out, in], end in "experts.down_proj")
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
_TIED_EMBED_STD = 0.15


@torch.no_grad()
def dummy_state(shapes: dict[str, torch.Size], num_layers: int, tied: bool, device: torch.device | str,
                dtype: torch.dtype, seed: int = 0, gain: float = 1.4,
                into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A state dict of `shapes` (parameter name -> shape) drawn on `device` in `dtype`. Each tensor has
    its own generator, seeded from `seed` and its name: tensor-parallel ranks, which draw only their
    shards, draw the replicated tensors alike. `into` (name -> an allocated tensor of that shape, e.g.
    the model's parameters): each draw is written there and that tensor is the state's, so the model
    and a drawn copy never take memory at once; the values are the same."""
    state = {}
    for name, shape in shapes.items():
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=torch.float32, device=device)
        if name.endswith("embed_tokens.weight"):
            t.normal_(0.0, _TIED_EMBED_STD if tied else 1.0, generator=gen)
        elif len(shape) >= 2:
            std = gain / shape[-1] ** 0.5  # fan-in: a matrix's columns (also each stacked expert's)
            if name.endswith(_RESIDUAL_OUTPUTS):
                std /= num_layers ** 0.5
            t.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            t.normal_(0.0, 0.5 if "qkv_proj" in name else 0.02, generator=gen)
        else:  # norm weights
            t.normal_(1.0, 0.1, generator=gen)
        if into is not None:
            state[name] = into[name].copy_(t)
        else:
            state[name] = t.to(dtype)
    return state
