"""Routing and bytes of a mixture-of-experts model for its decode benchmark (bench/moe_decode.py).

- `spread_routers`: random weights route unlike trained ones (the hidden states of a random stack share a
  large mean direction, so every token's router logits share one offset and a few experts take most
  tokens: a batch of 32 then reads a handful of experts and decodes faster than a trained model would).
  Each MoE layer's router is redrawn while one prefill runs through the stack (a forward pre-hook, layer by
  layer, so each layer sees the routing of the redrawn layers before it): random rows orthogonal to the
  mean of the layer's inputs, each scaled so that its expert's logit has unit variance over them. Every
  expert's logit then has mean 0 and variance 1 over the tokens, so top-k choices spread evenly. Works on
  ours (SparseMoE.gate, nn.Linear) and on HF's routers (`mlp.gate`, weight [experts, hidden]) alike.
- `ExpertProbe`: records the experts each layer's router picks during eager steps (forward hooks), and
  summarises them: the load histogram, its imbalance, and how many distinct experts `b` tokens from `b`
  different prompts at the same position hit (what a decode step of `b` streams reads).
- `step_bytes`: what one decode step of `b` sequences reads: every weight outside the experts once
  (attention, norms, routers, the output head; the embedding's `b` rows), the experts the step hits,
  and each sequence's KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def routers(model: nn.Module, num_experts: int, hidden: int) -> list[nn.Module]:
    """The MoE layers' router modules of `model`, in layer order: modules named `...mlp.gate` whose weight
    is [num_experts, hidden] (ours and HF's Qwen3-MoE routers)."""
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate")
            and getattr(m, "weight", None) is not None and tuple(m.weight.shape) == (num_experts, hidden)]


@torch.no_grad()
def spread_routers(found: list[nn.Module], prefill: Callable[[], None], seed: int = 0) -> None:
    """Redraw each router in `found` during `prefill()` (which must run the stack eagerly once, e.g. a
    prompt longer than the largest captured CUDA graph), as the module docstring says; RuntimeError when a
    router never ran."""
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()

    def redraw(module: nn.Module, args: tuple) -> None:
        if id(module) in done:
            return
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        mean = x.mean(dim=0)
        unit = mean / mean.norm().clamp_min(1e-30)
        rows = torch.randn(module.weight.shape, generator=gen).to(x.device)
        rows -= (rows @ unit)[:, None] * unit[None, :]  # no shared offset: every logit's mean is 0
        std = (x @ rows.t()).std(dim=0).clamp_min(1e-30) if x.shape[0] > 1 else rows.norm(dim=1)
        module.weight.copy_((rows / std[:, None]).to(module.weight.dtype))
        done.add(id(module))

    handles = [m.register_forward_pre_hook(redraw) for m in found]
    try:
        prefill()
    finally:
        for h in handles:
            h.remove()
    if len(done) != len(found):
        raise RuntimeError(f"router spread: {len(found) - len(done)} of {len(found)} routers did not run "
                           "eagerly during the calibration prefill (make its prompt longer than the largest "
                           "captured graph)")


class ExpertProbe:
    """Records the top_k experts each router picks while `recording` (forward hooks on the routers)."""

    def __init__(self, found: list[nn.Module], top_k: int) -> None:
        self.top_k = top_k
        self.picks: list[list[torch.Tensor]] = [[] for _ in found]  # per layer: [tokens, top_k] per call
        self.recording = False
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(found)]

    def _hook(self, layer: int) -> Callable:
        def record(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.recording and isinstance(out, torch.Tensor):
                self.picks[layer].append(out.float().topk(self.top_k, dim=-1).indices.cpu())
        return record

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()

    def layer_ids(self) -> list[torch.Tensor]:
        """Per layer, the [tokens, top_k] experts picked over every recorded call (empty when none ran)."""
        return [torch.cat(p) if p else torch.empty(0, self.top_k, dtype=torch.int64) for p in self.picks]


@dataclass(frozen=True)
class ExpertLoad:
    """What a probe saw: tokens routed per layer, the load histogram summed over layers, its imbalance
    (per layer, the busiest expert's share over the mean share: 1.0 is perfectly even), and the distinct
    experts per layer that `streams` tokens at one position of `streams` prompts hit, on average."""

    tokens: int
    histogram: list[int]
    imbalance_mean: float
    imbalance_max: float
    streams: int
    experts_per_step: float | None  # None with fewer tokens than streams


def expert_load(ids: list[torch.Tensor], num_experts: int, streams: int) -> ExpertLoad:
    """Summarise per-layer picks [tokens, top_k] of one prefill of `streams` prompts of (about) equal
    length, their tokens concatenated prompt by prompt as the engine schedules them: the tokens are cut
    into `streams` near-equal runs, and position j of every run is one step's tokens."""
    ids = [i for i in ids if i.numel()]
    if not ids:
        return ExpertLoad(0, [0] * num_experts, 0.0, 0.0, streams, None)
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=num_experts) for i in ids])
    share = counts.float() / counts.float().mean(dim=1, keepdim=True)
    imbalance = share.max(dim=1).values
    tokens = ids[0].shape[0]
    per_step = None
    if 0 < streams <= tokens:
        hits = []
        for layer in ids:  # one position of every prompt: one decode step's tokens
            prompts = torch.tensor_split(layer, streams)  # a token more or less where lengths differ
            positions = min(len(p) for p in prompts)
            hits += [len({e for p in prompts for e in p[j].tolist()}) for j in range(positions)]
        per_step = sum(hits) / len(hits)
    return ExpertLoad(tokens, counts.sum(dim=0).tolist(), imbalance.mean().item(), imbalance.max().item(),
                      streams, per_step)


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step reads, by part (model/moe.py's layout: experts under `.experts.`)."""

    shared: int  # every weight outside the experts and the embedding table, read once per step
    embedding_row: int  # one row of the input embedding (each sequence reads its token's)
    expert: float  # one expert of one layer (gate, up, down and any FP8 scales)
    moe_layers: int
    kv_per_token: int  # K and V of one token over every attention layer
    state_per_stream: int = 0  # a hybrid stack's linear-layer state, read and written by each stream's step

    def total(self, streams: int, experts_hit: float, context: float) -> float:
        """A step of `streams` sequences of `context` tokens each, hitting `experts_hit` experts per layer."""
        return (self.shared + streams * self.embedding_row + self.moe_layers * experts_hit * self.expert
                + streams * (context * self.kv_per_token + self.state_per_stream))


def step_bytes(model: nn.Module, kv_per_token: int, state_per_stream: int = 0) -> StepBytes:
    """StepBytes of our language model (decoder_svc LlamaForCausalLM, any quantization)."""
    cfg = model.config
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    shared = experts = 0
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        size = p.numel() * p.element_size()
        if ".experts." in name:
            experts += size
        elif p is not embed or tied:  # a tied table is read whole by the head
            shared += size
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    per_expert = experts / (moe_layers * cfg.num_experts) if moe_layers else 0.0
    return StepBytes(shared, embed.shape[1] * embed.element_size(), per_expert, moe_layers, kv_per_token,
                     state_per_stream)
