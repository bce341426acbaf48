"""bench/fleet_sim.py: counts, bounds and monotonic properties of the sizing simulation (no timing)."""

from __future__ import annotations

from bench.fleet_sim import Costs, Mix, Trace, main, make_trace, run, simulate, smallest_encoders

SMALL = Trace(peak_rps=60.0, slots=4, slot_seconds=5.0, seed=3)


def test_a_tiny_run_finishes_and_counts_every_request():
    requests = make_trace(SMALL, Mix())
    res = simulate(requests, decoders=4, encoders=2, costs=Costs())
    assert res["requests"] == len(requests) > 0
    assert all(r.ttft > 0 for r in requests)  # every request got its first token
    assert {r.kind for r in requests} == {"image", "text", "followup_hit", "followup_miss"}
    assert res["tower_images"] == sum(r.kind == "image" and r.tower for r in requests) > 0
    assert 0 < res["tower_batches"] <= res["tower_images"]
    # a request with an image waits for its Encode before its prefill; one without does not
    assert all(r.encode_done >= r.arrival for r in requests)
    assert all(r.encode_done == r.arrival for r in requests if r.image_u is None)


def test_utilisation_stays_within_one_even_overloaded():
    for encoders, rps in ((1, 200.0), (2, 60.0), (8, 20.0)):
        res = run(2, encoders, Trace(peak_rps=rps, slots=2, slot_seconds=5.0, seed=1), Mix(), Costs())
        assert 0 < res["encoder_utilisation"] <= 1
        assert 0 < res["decoder_prefill_utilisation"] <= 1
        assert 0 < res["decoder_mean_running"] <= Costs().max_running
    overloaded = run(2, 1, Trace(peak_rps=200.0, slots=2, slot_seconds=5.0, seed=1), Mix(), Costs())
    assert overloaded["encoder_utilisation"] > 0.9  # 1 encoder, ~100 images a second against ~60


def test_more_encoders_never_raise_the_p99_on_one_seed():
    for seed in (0, 5):
        trace = Trace(peak_rps=300.0, slots=3, slot_seconds=6.0, seed=seed)
        p99s = [run(20, e, trace, Mix(), Costs())["ttft_ms"]["p99"] for e in (1, 2, 3, 4, 16)]
        # from starved (1 encoder: ~100 images a second against ~60) to enough
        assert all(a > b for a, b in zip(p99s[:3], p99s[1:4], strict=True)), p99s
        assert p99s[0] > 10 * p99s[3]
        # past enough the p99 is the decoders' and moves only with which images share an encoder
        assert p99s[4] <= 1.1 * p99s[3], p99s


def test_the_trace_follows_the_day_and_repeats_on_its_seed():
    trace = Trace(peak_rps=100.0, slots=24, slot_seconds=2.0, seed=9)
    requests = make_trace(trace, Mix())
    assert [(r.kind, r.arrival) for r in requests] == [(r.kind, r.arrival) for r in make_trace(trace, Mix())]
    per_slot = [0] * 24
    for r in requests:
        per_slot[int(r.arrival // trace.slot_seconds)] += 1
    assert per_slot[16] > per_slot[4]  # 16:00 busier than 04:00
    assert trace.rate(16 * 3600) == 100.0
    assert trace.rate(4 * 3600) < trace.rate(10 * 3600) < trace.rate(16 * 3600)


def test_smallest_encoders_needs_every_larger_count_under_the_target():
    def res(e: int, p99: float) -> dict:
        return {"encoders": e, "ttft_ms": {"p99": p99}}

    assert smallest_encoders([res(4, 900), res(6, 400), res(8, 300)], 500) == 6
    assert smallest_encoders([res(4, 400), res(6, 600), res(8, 300)], 500) == 8  # 6 broke it
    assert smallest_encoders([res(4, 900)], 500) is None


def test_the_command_line_sweep(capsys, tmp_path):
    out = tmp_path / "sim.json"
    report = main(["--decoders", "4", "--sweep", "1,4", "--peak-rps", "80", "--slots", "2",
                   "--slot-seconds", "4", "--ttft-p99-ms", "100000", "--out", str(out)])
    assert [r["encoders"] for r in report["results"]] == [1, 4]
    assert report["smallest_encoders"] == 1
    assert out.exists() and "| 4 |" in capsys.readouterr().out
