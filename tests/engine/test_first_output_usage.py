"""The prompt's counts are on a request's first output (not only its last): a stream with usage on every
chunk (vLLM's continuous_usage_stats, through the gateway) shows prompt_tokens from the first token on."""

from __future__ import annotations

from decoder_svc.engine import SamplingParams


def test_the_first_and_last_outputs_carry_usage(make_engine):
    engine = make_engine()
    engine.add_request("r", "USER: hello there ASSISTANT:",
                       sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == "r" and o.new_token_ids]
    first, *middle, last = outputs
    assert first.usage is not None and first.usage.prompt_tokens == last.usage.prompt_tokens > 0
    assert first.usage.completion_tokens == len(first.new_token_ids)
    assert all(o.usage is None for o in middle)  # later outputs stay small: the last one has the totals
    assert last.usage.completion_tokens == 4
