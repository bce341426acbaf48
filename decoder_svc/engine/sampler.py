"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, and logprobs.

Logprobs always come from log_softmax of the raw logits (before temperature and truncation), which is
what HF's `output_logits` gives; for greedy decoding they also equal HF's `output_scores`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder_svc.engine.request import Request


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-N alternatives."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    """One sampled token (and optional logprobs) per input row."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top k and outside the smallest nucleus of mass top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    """Samples one token per row; keeps one torch.Generator per seeded request."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, req: Request, device: torch.device) -> torch.Generator | None:
        if req.sampling.seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(req.sampling.seed)
            self._generators[req.request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: fp32 [rows, vocab], row i belonging to requests[i]."""
        tokens = logits.argmax(dim=-1).tolist()  # one device sync for every greedy row
        for i, req in enumerate(requests):
            sp = req.sampling
            if sp.greedy:
                continue
            x = apply_top_k_top_p(logits[i] / sp.temperature, sp.top_k, sp.top_p)
            probs = torch.softmax(x, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generator(req, logits.device)))
        return SamplerOutput(tokens, self._logprobs(logits, requests, tokens))

    @staticmethod
    def _logprobs(logits: torch.Tensor, requests: list[Request],
                  tokens: list[int]) -> list[TokenLogprobs | None]:
        n_max = max((r.sampling.logprobs for r in requests), default=0)
        if n_max == 0:
            return [None] * len(requests)
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(lp, n_max, dim=-1)
        chosen = lp[torch.arange(len(tokens), device=lp.device), torch.tensor(tokens, device=lp.device)]
        chosen, top_vals, top_ids = chosen.tolist(), top.values.tolist(), top.indices.tolist()
        out: list[TokenLogprobs | None] = []
        for i, req in enumerate(requests):
            n = req.sampling.logprobs
            out.append(TokenLogprobs(chosen[i], top_ids[i][:n], top_vals[i][:n]) if n else None)
        return out
