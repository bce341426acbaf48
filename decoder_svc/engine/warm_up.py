"""The decoder's warm-up: requests run before the service says it is ready.

The short warm-up is one 2-token text request: every layer runs once, and a KV cache too small for one
request of the default length is refused. The full warm-up (the default on a GPU) also runs what a first
cold request and its follow-up would, so that the first users do not pay for compiling kernels: a GPU
compiles a Triton kernel once per specialisation of its integer arguments (1, a multiple of 16, any other
value) and fla autotunes its kernels per key on first use, and the start-up forward (the largest prefill,
one token) and the graphs' capture reach only some of those (a first cold prompt of a hybrid model took
9.9 s on an H100 for that reason). It runs, greedy, 2 tokens each:

- a long prompt (past the largest CUDA graph, so computed eagerly, and not a multiple of 16 tokens) beside
  a shorter one in the same step: two sequences of a packed prefill; for a hybrid stack, a prompt that
  crosses a snapshot interval, so that its state is read from the chunked rule's chunk states, and whose
  last block boundary is off that 64-token grid (a cut and a short tail);
- then a request sharing the long prompt's full blocks with a new ending: a prefix hit (from a snapshot
  for a hybrid stack) whose short step replays a mixed graph;
- with LoRA adapters served, the shorter prompt under the first one.

Then the prefix cache is emptied and the counters zeroed: users' requests find the engine as it was after
start-up. A warm-up request that fails fails the start (what would fail a user's request should not pass
for ready).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decoder_svc.engine.engine import LLMEngine
from decoder_svc.engine.sampling_params import InvalidRequestError, SamplingParams

# Tokens of the long prompt: past a 64-block snapshot interval of 16-token blocks (1024) and the largest
# mixed graph (512), 5 past a multiple of 16, its last block boundary (1104) off the 64-token grid.
LONG_PROMPT = 1109
SHORT_PROMPT = 333  # the second sequence of the long prompt's step (also off a multiple of 16)
FOLLOW_UP_TAIL = 27  # new tokens after the long prompt's full blocks
_TEXT = "The quick brown fox jumps over the lazy dog while a small bird sings on the old stone wall. "
_OTHER = "Describe the picture again, this time in fewer words and with the colours first. "


class WarmUpError(RuntimeError):
    """A warm-up request failed: the engine would fail users' requests of that shape."""


@dataclass(frozen=True)
class _Prompt:
    request_id: str
    token_ids: list[int]
    lora_adapter: str = ""


def warm_up(engine: LLMEngine, full: bool) -> None:
    """Run the warm-up requests (the module docstring), then empty the prefix cache and zero the stats.
    Raises InvalidRequestError when the KV cache cannot hold one request of the default length (a
    configuration error) and WarmUpError when a warm-up request fails."""
    capacity = engine.kv_spec.num_blocks * engine.kv_spec.block_size
    if capacity <= engine.config.default_max_tokens:
        raise InvalidRequestError(f"the KV cache holds {capacity} tokens, fewer than one request of "
                                  f"--max-tokens-default {engine.config.default_max_tokens}")
    out = engine.generate("warm-up", "warm up", sampling=SamplingParams(max_tokens=2))
    if out.error:
        raise WarmUpError(f"the warm-up request failed: {out.error}")
    if full:
        for batch in warm_up_batches(engine):
            _run_together(engine, batch)
    engine.reset_prefix_cache()
    engine.reset_stats()  # stats count users' requests only


def warm_up_batches(engine: LLMEngine) -> list[list[_Prompt]]:
    """The full warm-up's requests, batch by batch (each batch's requests queued together): none when
    the model's context or the KV cache is too small for them."""
    block = engine.kv_spec.block_size
    capacity = engine.kv_spec.num_blocks * block
    room = min(LONG_PROMPT, engine.model_config.max_model_len - FOLLOW_UP_TAIL - 4, capacity // 3)
    longest = (room - 5) // 16 * 16 + 5  # 5 past a multiple of 16, as LONG_PROMPT
    if longest < 4 * block:
        return []
    text = _token_ids(engine, _TEXT, longest)
    short = _token_ids(engine, _OTHER, min(SHORT_PROMPT, longest // 2))
    shared = (longest - 1) // block * block  # the long prompt's full blocks (the hit never covers the last)
    follow_up = text[:shared] + _token_ids(engine, _OTHER, FOLLOW_UP_TAIL)
    first = [_Prompt("warm-up-long", text), _Prompt("warm-up-short", short)]
    adapters = engine.config.served_adapters
    if adapters:
        first.append(_Prompt("warm-up-adapter", short, adapters[0]))
    return [first, [_Prompt("warm-up-follow-up", follow_up)]]


def _token_ids(engine: LLMEngine, text: str, length: int) -> list[int]:
    """`length` ids of `text` repeated: plain text tokens in the model's vocabulary, no placeholder."""
    tokenizer = engine.tokenizer
    placeholders = tokenizer.placeholder_token_ids
    vocab = engine.model_config.vocab_size
    ids = [i for i in tokenizer.tokenizer.encode(text, add_special_tokens=False)
           if 0 <= i < vocab and i not in placeholders]
    if not ids:
        raise WarmUpError("the tokenizer gives no plain text ids for the warm-up prompt")
    return (ids * (length // len(ids) + 1))[:length]


def _run_together(engine: LLMEngine, prompts: Sequence[_Prompt]) -> None:
    """Queue the prompts at once (2 tokens each) and step until every one has finished."""
    for p in prompts:
        engine.add_request(p.request_id, prompt_token_ids=p.token_ids, lora_adapter=p.lora_adapter,
                           sampling=SamplingParams(max_tokens=2))
    open_ids = {p.request_id for p in prompts}
    while open_ids and engine.has_unfinished():
        for out in engine.step():
            if out.request_id in open_ids and out.finished:
                if out.error:
                    raise WarmUpError(f"warm-up request {out.request_id} failed: {out.error}")
                open_ids.discard(out.request_id)
    while engine.has_unfinished():  # an asynchronous step may still be in flight
        engine.step()
