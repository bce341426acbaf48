"""The engine core's loop (decoder_svc/engine_core.py) over a real pipe, in a thread: a request added
through the pipe with its image file following it, its outputs back, the arrival stamp that splits
`submit` from `inbox`, and the step trace (decoder_svc/step_trace.py, summarised by bench/step_trace.py)."""

from __future__ import annotations

import multiprocessing
import threading

from bench.step_trace import read_trace, summarize
from common.images import encode_png
from decoder_svc import core_protocol as msg
from decoder_svc.engine.following_bytes import detach_files
from decoder_svc.engine.sampling_params import SamplingParams
from decoder_svc.engine_core import EngineCore
from decoder_svc.step_trace import StepTrace

ONE = "USER: <image>\nWhat is this? ASSISTANT:"


def test_a_request_through_the_pipe_is_stamped_served_and_traced(make_engine, images, tmp_path):
    engine = make_engine()
    front, back = multiprocessing.Pipe()
    trace_path = tmp_path / "steps.jsonl"
    trace = StepTrace(str(trace_path))
    core = EngineCore(engine, back, trace)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        req = engine.inputs.make_request("r", ONE, [encode_png(images[0])],
                                         sampling=SamplingParams(max_tokens=3, ignore_eos=True))
        req.times.received, req.times.made = 0.5, 1.0  # the front end's stamps (monotonic, as the core's)
        files = detach_files(req.images)
        assert files, "the image file follows its request"
        front.send(msg.AddRequest(7, req))
        front.send(msg.ImageBytes("r", files))
        outputs = []
        while not (outputs and outputs[-1].finished):
            message = front.recv()
            if isinstance(message, msg.Reply):
                assert message.ok and message.token == 7
            else:
                outputs += message.outputs
        front.send(msg.Close())
        loop.join(30)
    finally:
        trace.close()
        core.wakeup.close()
    assert sum(len(o.new_token_ids) for o in outputs) == 3, outputs[-1].error
    times = next(o.times for o in outputs if o.times is not None)
    assert 1.0 < times.arrived <= times.added <= times.step_started  # read off the pipe, then queued
    records = read_trace(trace_path)
    assert records and sum(r["sampled"] for r in records) == 1
    assert [r for rec in records for r in rec["received"]] == [0.5]  # the first token's step names it
    assert sum(r["tokens"] for r in records) >= len(req.prompt_token_ids) + 2
    assert records[0]["commands"] == 1 and records[0]["prefill"] == 1
    # the burst timeline's fields: which request each prompt chunk was, and the first token's stamps
    chunks = [c for rec in records for c in rec["prefilled"]]
    assert {c[0] for c in chunks} == {"r"} and chunks[0][1] == 0
    assert sum(c[2] for c in chunks) == len(req.prompt_token_ids)
    firsts = [f for rec in records for f in rec["firsts"]]
    assert [f[:2] for f in firsts] == [["r", 0.5]] and firsts[0][2] == times.added
    summary = summarize(records)
    assert summary["steps"] == len(records) and summary["first_tokens"] == 1 and 0 < summary["busy"] <= 1
