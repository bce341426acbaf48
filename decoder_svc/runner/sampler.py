"""Vectorized token selection for the model runner: greedy, temperature, top-k, top-p, seeds, logprobs.

One call handles the whole batch with tensor ops; the only Python loop over rows builds the per-row
parameters and draws the noise of seeded requests from their own generators. Tokens come back through a
single device-to-host synchronisation, which `sample_async` leaves to the caller (the next step is
launched before it).

Sampling uses the exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with
probability probs[i] (the Gumbel-max trick in disguise). Unlike torch.multinomial it never raises on a bad
distribution and needs no host sync.

Logprobs always come from log_softmax of the raw logits (before temperature and truncation), which is what
HF's `output_logits` gives; for greedy decoding they also equal HF's `output_scores`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from decoder_svc.runner.argmax import argmax_rows


class RowParams(Protocol):
    """What the sampler reads of a row's sampling parameters (the engine's SamplingParams is one: a
    Protocol, as the engine sits above the runner and imports this module)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    logprobs: int

    @property
    def greedy(self) -> bool: ...


# Below this temperature (or when it is not finite) a row is decoded greedily: logits / temperature would
# overflow fp32 or turn into NaN, and such a distribution is argmax anyway.
MIN_TEMPERATURE = 1e-5

_SEED_MASK = (1 << 64) - 1  # torch.Generator.manual_seed takes [-2**63, 2**64); wrap anything else into it


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


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits: whose it is and how to pick its token."""

    request_id: str
    params: RowParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside its row's top k and outside the smallest nucleus of mass top_p.

    logits: [B, V] float; top_k: [B] long (0, or >= V, means off); top_p: [B] float (<= 0, >= 1 or NaN means
    off). Top-k keeps the k largest logits (ties with the k-th value are kept too); top-p then keeps the
    smallest prefix of the remaining tokens, in descending order, whose probability mass reaches top_p; the
    top token always stays. Returns a new tensor; one descending sort of the batch does both.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)

    k_on = (top_k > 0) & (top_k < vocab)
    kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
    # Compare by value, not position, so ties with the k-th value survive (as torch.topk-based masking does).
    drop = k_on.unsqueeze(1) & (sorted_logits < kth)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    p_on = (top_p > 0) & (top_p < 1)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p; the mass before the top token is 0, so it
    # always stays. The nucleus is taken on the top-k-renormalised distribution, as in the per-row sampler.
    drop |= p_on.unsqueeze(1) & ((probs.cumsum(dim=-1) - probs) >= top_p.to(probs.dtype).unsqueeze(1))

    # order is a permutation per row, so scattering drop back covers every position of the empty mask.
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def _is_greedy(params: RowParams) -> bool:
    """Argmax for this row: asked for, or a temperature the sampler cannot divide by safely."""
    t = params.temperature
    return params.greedy or not math.isfinite(t) or t < MIN_TEMPERATURE


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    """Start copying t to (pinned) host memory without waiting; readable after the next stream sync."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class PendingSample:
    """A batch's sampled tokens: on the device now (`tokens`), on the host once `result()` returns."""

    def __init__(self, tokens: torch.Tensor, logprobs: tuple[list[int], list[torch.Tensor]] | None,
                 host_tokens: torch.Tensor | None) -> None:
        self.tokens = tokens
        self._logprobs = logprobs
        self._host = host_tokens
        self._copied = None
        if tokens.device.type == "cuda" and tokens.numel():
            # Recorded after the copies to the host (tokens and logprobs), on the same stream.
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SamplerOutput:
        """Wait for the host copies (the one synchronisation of a step) and return the tokens."""
        if self._host is None:
            return SamplerOutput([], [])
        if self._copied is not None:
            self._copied.synchronize()
        return SamplerOutput(self._host.tolist(), Sampler.read_logprobs(self._logprobs, self._host.numel()))


class Sampler:
    """Samples one token per row for a whole batch at once; keeps one torch.Generator per seeded request."""

    def __init__(self, device: torch.device | str) -> None:
        """device: where the logits will live; on CUDA the per-row parameters are staged in pinned memory."""
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator (no-op if it has none)."""
        self._generators.pop(request_id, None)

    def _generator(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        gen = self._generators.get(row.request_id)
        if gen is None:
            assert row.params.seed is not None
            gen = torch.Generator(device=device)
            gen.manual_seed(int(row.params.seed) & _SEED_MASK)
            self._generators[row.request_id] = gen
        return gen

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Pick one token per row. logits: [B, V] in the head's dtype or fp32, row i belonging to rows[i].

        Never raises on odd values (NaN/inf logits, degenerate temperatures): every row gets a valid id.
        Synchronises with the device exactly once, to read the token ids (and logprobs, if asked for).
        """
        return self.sample_async(logits, rows).result()

    @torch.no_grad()
    def sample_async(self, logits: torch.Tensor, rows: list[SamplingRow]) -> PendingSample:
        """`sample` without waiting: the tokens stay on the device (the next step may read them there)
        and their copy to the host is queued; PendingSample.result() waits for it."""
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {n} rows")
        if n == 0:
            return PendingSample(torch.empty(0, dtype=torch.int64, device=logits.device), None, None)

        greedy = [_is_greedy(r.params) for r in rows]
        # Greedy rows use this same argmax in both paths, so their token does not depend on batch company;
        # it reads the logits as the head wrote them (an all-greedy step widens nothing to fp32).
        tokens = argmax_rows(logits)
        if not all(greedy) or any(r.params.logprobs for r in rows):
            logits = logits.float()
        if not all(greedy):
            tokens = self._sample_mixed(logits, rows, greedy, tokens)
        return PendingSample(tokens, self._logprobs_async(logits, rows, tokens), _to_host_async(tokens))

    def _sample_mixed(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool],
                      greedy_tokens: torch.Tensor) -> torch.Tensor:
        """Tokens for a batch with at least one non-greedy row, as a device tensor (no host sync)."""
        vocab = logits.shape[1]
        device = logits.device
        temps: list[float] = []
        ks: list[int] = []
        ps: list[float] = []
        for row, g in zip(rows, greedy, strict=True):
            sp = row.params
            if g:
                # Neutral values: the row is overwritten by its argmax, and it should not force a sort.
                temps.append(1.0)
                ks.append(0)
                ps.append(0.0)
            else:
                temps.append(float(sp.temperature))
                ks.append(sp.top_k if 0 < sp.top_k < vocab else 0)
                ps.append(float(sp.top_p) if 0.0 < sp.top_p < 1.0 else 0.0)  # NaN fails both: off
        truncate = any(ks) or any(ps)

        # One host->device copy for all per-row parameters; float64 holds top_k (< 2**53) exactly.
        host = torch.tensor([temps, ks, ps, greedy], dtype=torch.float64, pin_memory=self._pin and
                            device.type == "cuda")
        params = host.to(device, non_blocking=True)
        temperature = params[0].to(logits.dtype)
        is_greedy = params[3].bool()

        x = logits / temperature.unsqueeze(1)
        if truncate:
            x = apply_top_k_top_p(x, params[1].long(), params[2].to(logits.dtype))
        probs = torch.softmax(x, dim=-1)
        # A NaN/inf logit makes the whole row's softmax NaN; such rows fall back to argmax below.
        bad = probs.isnan().any(dim=-1)

        # Unseeded rows share one draw from the default generator; each seeded row then redraws its noise
        # from its own generator, so its tokens depend only on its seed and its logits, not on its position.
        noise = torch.empty_like(probs).exponential_()
        for i, row in enumerate(rows):
            if not greedy[i] and row.params.seed is not None:
                noise[i].exponential_(generator=self._generator(row, device))
        # Guard against an exact 0 draw: masked tokens (prob 0) would give 0/0 = NaN and win the argmax.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = probs.div_(noise).argmax(dim=-1)

        fallback = torch.nan_to_num(logits, nan=float("-inf")).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, torch.where(bad, fallback, sampled))

    @staticmethod
    def _logprobs_async(logits: torch.Tensor, rows: list[SamplingRow],
                        tokens: torch.Tensor) -> tuple[list[int], list[torch.Tensor]] | None:
        """Queue the logprob computation and its copy to host; None when no row asks for logprobs."""
        vocab = logits.shape[1]
        counts = [min(max(int(r.params.logprobs), 0), vocab) for r in rows]
        n_max = max(counts)
        if n_max == 0:
            return None
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, n_max, dim=-1)
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return counts, [_to_host_async(t) for t in (chosen, top.values, top.indices)]

    @staticmethod
    def read_logprobs(pending: tuple[list[int], list[torch.Tensor]] | None,
                       n: int) -> list[TokenLogprobs | None]:
        """Turn the host copies into per-row TokenLogprobs, each trimmed to its own N (after the sync)."""
        if pending is None:
            return [None] * n
        counts, (chosen_t, values_t, ids_t) = pending
        chosen, values, ids = chosen_t.tolist(), values_t.tolist(), ids_t.tolist()
        return [TokenLogprobs(chosen[i], ids[i][:k], values[i][:k]) if k else None
                for i, k in enumerate(counts)]
