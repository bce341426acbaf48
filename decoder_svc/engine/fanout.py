"""One prompt, n samples (the API's GenerateRequest.n): the prompt is held, and prefilled, once.

A request with n > 1 is scheduled as one request up to its prompt's last token (`Request.schedule_end`).
Then the scheduler forks it: the request becomes choice 0 and n - 1 new requests, choices 1..n-1, start
from its KV. Each child holds the parent's full blocks by reference count (as a prefix-cache hit does)
and a copy of its last, partial block, which every sample writes into (copy on write: the runner copies
the block before the step that computes the children's first tokens). Every choice then computes the
prompt's last token itself and samples its own first token from it: n tokens, a decode step's worth,
instead of n prefills.

Choice i samples as a request of its own with seed + i would (vLLM's parallel samples, and what the
gateway did when it sent n requests): its own id, its own seeded generator, its own stop conditions. Its
outputs go to the parent's stream (`Request.output_id`) with its `choice` as their index.

Where the KV cannot be shared (an image covers the prompt's last token, a one-token prompt) or the step
has no room for a child (its sequence budget, or no free block for its copy), the child is queued as a
request of its own, with the parent's images (the same bytes, not a copy): it finds the prompt's full
blocks in the prefix cache while the parent holds them, and recomputes only the rest.
"""

from __future__ import annotations

import dataclasses

from decoder_svc.engine.embedding_source import EmbeddingState
from decoder_svc.engine.request import ImagePlaceholder, Request, RequestStatus

MAX_SAMPLES = 128  # samples of one prompt at most (OpenAI's bound on `n`)
_SEED_MOD = 2**64


def child_id(parent_id: str, choice: int) -> str:
    """The engine's id of a forked choice (choice 0 keeps the parent's)."""
    return f"{parent_id}#{choice}"


def child_seed(seed: int | None, choice: int) -> int | None:
    """Choice i's seed: seed + i (mod 2**64), as vLLM seeds its parallel samples; None stays None."""
    return None if seed is None else (seed + choice) % _SEED_MOD


def shares_prefill(req: Request) -> bool:
    """Whether the request's samples can fork from its KV: the prompt's last token, which each sample
    computes itself, must be text (no image's rows are needed after the fork)."""
    last = req.num_prompt_tokens - 1
    return last >= 1 and all(img.end <= last for img in req.images)


def fork_child(parent: Request, choice: int, in_kv: bool) -> Request:
    """Choice `choice` of the parent's prompt: its sampling with its own seed, its images (the same bytes
    and rows' keys) in the state the fork leaves them. `in_kv`: it starts from the parent's KV (the
    caller gives it the blocks), its images computed; else it is queued fresh, its images not asked for."""
    sampling = dataclasses.replace(parent.sampling, seed=child_seed(parent.sampling.seed, choice),
                                   stop=list(parent.sampling.stop),
                                   stop_token_ids=list(parent.sampling.stop_token_ids))
    child = Request(
        request_id=child_id(parent.request_id, choice), prompt_token_ids=parent.prompt_token_ids,
        sampling=sampling, max_tokens=parent.max_tokens, eos_token_ids=parent.eos_token_ids,
        images=[_image_copy(img, in_kv) for img in parent.images], cache_salt=parent.cache_salt,
        lora_adapter=parent.lora_adapter, arrival_time=parent.arrival_time,
        mrope_positions=parent.mrope_positions, mrope_delta=parent.mrope_delta,
        choice=choice, stream_id=parent.request_id)
    if in_kv:
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
    return child


def _image_copy(img: ImagePlaceholder, in_kv: bool) -> ImagePlaceholder:
    if in_kv:  # every token of it is in the shared KV: nothing to hold (asked for again if preempted)
        return dataclasses.replace(img, state=EmbeddingState.DONE, needed_now=False)
    return dataclasses.replace(img, state=EmbeddingState.UNKNOWN, encoder_cache_hit=False,
                               skipped_by_kv_reuse=False, needed_now=False)
