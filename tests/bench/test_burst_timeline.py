"""bench/burst_timeline.py on a synthetic step trace: per-request rows, the table, the PNG."""

from __future__ import annotations

import json

import pytest

from bench import burst_timeline
from bench.step_trace import read_trace
from decoder_svc.step_trace import StepRecord, StepTrace

T0 = 100.0  # the monotonic clock at the burst


def _record(t: float, s: float, prefilled: list, firsts: list) -> StepRecord:
    tokens = sum(c[2] for c in prefilled)
    return StepRecord(t=T0 + t, s=s, tokens=tokens, prefill=len(prefilled), decode=0, sampled=len(firsts),
                      running=2, waiting=1, commands=0, idle=0.0, received=[f[1] for f in firsts],
                      prefilled=prefilled, firsts=firsts)


@pytest.fixture
def trace(tmp_path):
    """Three requests received at T0 (b 1 ms later); a's and b's images ready at 50 and 60 ms, c needs none.
    a: two chunks (steps at 50 and 70 ms), first token at 90 ms; b: one chunk sharing a's second step
    and one more, first token at 110 ms; c: one chunk, first token at 130 ms."""
    path = tmp_path / "steps.jsonl"
    writer = StepTrace(str(path))
    writer.write(_record(0.010, 0.005, [], []))  # an empty step before any embedding
    writer.write(_record(0.050, 0.020, [["a", 0, 16]], []))
    writer.write(_record(0.070, 0.020, [["a", 16, 8], ["b", 0, 8]],
                         [["a", T0, T0 + 0.0005, T0 + 0.050]]))
    writer.write(_record(0.090, 0.020, [["b", 8, 16]], []))
    writer.write(_record(0.110, 0.020, [["c", 0, 10]], [["b", T0 + 0.001, T0 + 0.0015, T0 + 0.060]]))
    writer.write(_record(0.130, 0.010, [], [["c", T0 + 0.002, T0 + 0.0025, 0.0]]))
    writer.close()
    with open(path, "a") as f:
        f.write('{"t": 1')  # a line cut by a killed core is skipped
    return path


def test_rows_follow_each_request_from_arrival_to_first_token(trace):
    rows = burst_timeline.build_timelines(read_trace(trace))
    assert [r.request_id for r in rows] == ["a", "b", "c"]
    a, b, c = rows
    assert a.arrival_ms == 0 and a.added_ms == pytest.approx(0.5) and a.images_ready_ms == pytest.approx(50)
    assert [(ch.start_ms, ch.end_ms, ch.tokens) for ch in a.chunks] == [
        pytest.approx((50, 70, 16)), pytest.approx((70, 90, 8))]
    assert a.first_token_ms == pytest.approx(90) and a.ttft_ms == pytest.approx(90)
    assert b.arrival_ms == pytest.approx(1) and b.prefill_start_ms == pytest.approx(70)
    assert [ch.tokens for ch in b.chunks] == [8, 16] and b.first_token_ms == pytest.approx(130)
    assert c.images_ready_ms is None and len(c.chunks) == 1 and c.ttft_ms == pytest.approx(140 - 2)


def test_chunks_after_the_first_token_are_left_out(trace):
    records = read_trace(trace)
    records.append({**records[2], "t": T0 + 0.5, "prefilled": [["a", 0, 24]], "firsts": []})  # a recompute
    a = burst_timeline.build_timelines(records)[0]
    assert len(a.chunks) == 2


def test_a_trace_without_the_fields_gives_no_rows(trace):
    old = [{k: v for k, v in r.items() if k not in ("prefilled", "firsts")} for r in read_trace(trace)]
    assert burst_timeline.build_timelines(old) == []


def test_the_table_the_png_and_the_json(trace, tmp_path, capsys):
    png, rows_json = tmp_path / "burst.png", tmp_path / "rows.json"
    assert burst_timeline.main([str(trace), "--png", str(png), "--json", str(rows_json)]) == 0
    printed = capsys.readouterr().out
    assert "first token ms" in printed and all(rid in printed for rid in "abc")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    rows = json.loads(rows_json.read_text())
    assert [r["request_id"] for r in rows] == ["a", "b", "c"] and len(rows[0]["chunks"]) == 2
    assert burst_timeline.table_rows(burst_timeline.build_timelines(read_trace(trace)))[0][4] == 2
