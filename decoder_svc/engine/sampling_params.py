"""Per-request sampling settings, validated once when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.errors import InvalidInputError
from decoder_svc.runner.sampler import MIN_TEMPERATURE

MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256


class InvalidRequestError(InvalidInputError):
    """A request the engine refuses (the service answers INVALID_ARGUMENT)."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy; top_k 0 and top_p 0 mean off."""

    max_tokens: int = 0  # 0: the engine's default
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0  # N > 0: each new token's logprob and the top N
    min_tokens: int = 0  # vLLM's: no stop (EOS, stop id or string) ends the output before this many tokens

    def stops_allowed(self, num_output_tokens: int) -> bool:
        """Whether a stop may end an output that has num_output_tokens tokens, the stopping one included.
        As in vLLM, min_tokens tokens come before the stop (here an early EOS stays in the output, as with
        ignore_eos, where vLLM masks its logit: no runner change for a rarely used option)."""
        return num_output_tokens > self.min_tokens

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError for values no sampler can honour."""
        if self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens and self.min_tokens > self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                                      f"got {self.min_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, "
                                      f"got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:  # NaN fails this too
            raise InvalidRequestError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.logprobs <= vocab_size:
            raise InvalidRequestError(f"logprobs must be in [0, {vocab_size}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s.encode()) > MAX_STOP_BYTES for s in self.stop):
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_BYTES} bytes "
                                      "each")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS * 16:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS * 16} stop_token_ids")
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids out of the vocabulary")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1
