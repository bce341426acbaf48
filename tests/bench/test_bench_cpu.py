"""The CPU path of every benchmark runs on the tiny model and writes well-formed JSON, tables and PNGs.

Speed is not checked. One encoder and a decoder (lookahead 4) are started once for the module and
shared by the serving benchmarks (the lookahead benchmark spawns its own pair of decoders); counts are
tiny so the module takes about a minute on 2 cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import (
    decode_tput,
    encode_cache,
    encode_tput,
    handoff,
    lookahead,
    merge,
    profile_step,
    serve_tput,
    ttft,
    ttft_prefix,
)
from bench.plot import _plot_pillow, plot_cdfs
from bench.services import decoder_service, encoder_service, start_all
from bench.stats import percentile, summarize
from bench.workload import image_schedule
from common.cli import main as cli_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DECODER_ARGS = ["--num-kv-blocks", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    """{"encoder", "on"} addresses of services started together on the tiny model."""
    logs = tmp_path_factory.mktemp("bench-logs")
    enc = encoder_service(tiny_model_dir, logs)
    on = decoder_service(tiny_model_dir, enc.address, logs, extra=[*DECODER_ARGS, "--encoder-max-ahead", "4"],
                         name="decoder-on")
    start_all([enc, on], timeout=180)
    yield {"encoder": enc.address, "on": on.address}
    for svc in (on, enc):
        svc.stop()


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-out")


def _load(path: Path) -> dict:
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    payload = json.loads(text)
    assert {"benchmark", "env", "config", "results"} <= payload.keys()
    assert payload["env"]["device"] == "cpu" and payload["env"]["date_utc"]
    return payload


def _is_latency(summary: dict, n: int | None = None) -> None:
    assert {"n", "mean_ms", "p50_ms", "p99_ms"} <= summary.keys()
    assert summary["n"] > 0 and (n is None or summary["n"] == n)
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]


def test_helpers(tmp_path):
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
    assert summarize([0.001, 0.003])["mean_ms"] == pytest.approx(2.0)
    schedule = image_schedule(10, 0.5, seed=3)
    assert schedule[0] == (0, False) and sum(r for _, r in schedule) == 5
    assert all(img < sum(not r for _, r in schedule[:i]) for i, (img, r) in enumerate(schedule) if r)
    samples = {"ttft": {"a": [0.01, 0.02], "b": [0.03]}, "e2e": {"a": [0.1]}}
    _plot_pillow(samples, tmp_path / "p.png", "pillow fallback")
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)
    assert plot_cdfs(samples, tmp_path / "m.png") in ("matplotlib", "pillow")
    assert (tmp_path / "m.png").read_bytes().startswith(PNG_MAGIC)


def test_serve_via_cli(services, tiny_model_dir, out_dir, capsys):
    code = cli_main(["bench", "--addr", services["on"], "--encoder", services["encoder"],
                     "--model", str(tiny_model_dir), "--num-requests", "8", "--concurrency", "4",
                     "--prompt-len", "8", "--shared-len", "24", "--output-len", "4", "--warmup", "1",
                     "--request-rate", "50", "--out", str(out_dir / "serve.json"),
                     "--plot", str(out_dir / "serve.png"), "--no-progress"])
    assert code == 0
    res = _load(out_dir / "serve.json")["results"]
    assert res["completed"] == 8 and res["failed"] == 0 and res["total_output_tokens"] == 32
    for metric in ("ttft", "tpot", "itl", "e2e"):
        _is_latency(res[metric])
    assert res["request_throughput_rps"] > 0 and res["output_token_throughput_tps"] > 0
    cache = res["cache"]
    assert 0 <= cache["prefix_cache_hit_rate"] <= 1 and 0 <= cache["encoder_cache_hit_rate"] <= 1
    assert cache["images_skipped_by_kv_reuse"] >= 0 and res["repeat_requests"] == 4
    assert (out_dir / "serve.png").read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "prefix-cache hit rate" in printed


def test_handoff(services, out_dir):
    handoff.main(["--encoder", services["encoder"], "--iters", "3", "--out", str(out_dir / "handoff.json")])
    results = _load(out_dir / "handoff.json")["results"]
    assert {r["transport"] for r in results} == {"shm", "inline"}
    for r in results:
        _is_latency(r["total"], 3)
        assert r["all_cache_hits"] and r["nbytes"] == 16 * 64 * 4 and r["first_call_ms"] > 0


def test_encode_cache(services, out_dir):
    encode_cache.main(["--encoder", services["encoder"], "--iters", "2", "--image-size", "32",
                       "--out", str(out_dir / "encode_cache.json")])
    res = _load(out_dir / "encode_cache.json")["results"]
    for case in ("miss", "hit_bytes", "hit_hash"):
        _is_latency(res[case], 2)
    assert res["unexpected_cache_flags"] == 0 and res["transport"] == "shm"


def test_encode_tput(services, tiny_model_dir, out_dir):
    encode_tput.main(["--encoder", services["encoder"], "--model", str(tiny_model_dir), "--images", "6",
                      "--image-size", "32", "--concurrency", "1,3", "--hf-batches", "1,3",
                      "--host-threads", "2", "--seed", "4242", "--out", str(out_dir / "encode_tput.json")])
    payload = _load(out_dir / "encode_tput.json")
    res = payload["results"]
    assert [r["concurrency"] for r in res["encode"]] == [1, 3]
    for r in res["encode"]:
        _is_latency(r["latency"], 6)
        assert r["images_per_s"] > 0 and r["cache_hits"] == 0, "distinct images: every Encode a miss"
    assert [r["batch"] for r in res["hf"]] == [1, 3] and all(r["images_per_s"] > 0 for r in res["hf"])
    assert res["targets"]["encode_c3_vs_best_hf"] > 0 and res["targets"]["c1_p50_over_hf_batch1"] > 0
    assert {"decode_hash_hf", "decode_hash_uint8", "decode_hash_threads", "decode_hash_processes"} == res[
        "host"]["scaling"].keys()
    per_image = res["host"]["per_image"]
    assert per_image["decode_png_ms"] > 0 and per_image["decode_png_array_ms"] > 0
    assert int(payload["encoder_stats"]["encodes"]) >= 6 * 2  # (u)int64 fields come as strings in JSON


def test_ttft_prefix(services, tiny_model_dir, out_dir):
    ttft_prefix.main(["--addr", services["on"], "--model", str(tiny_model_dir), "--rounds", "1",
                      "--prompt-len", "60", "--image-size", "32", "--out", str(out_dir / "ttft.json")])
    res = _load(out_dir / "ttft.json")["results"]
    for case in ttft_prefix.CASES:
        _is_latency(res[case], 1)
    assert res["warm_prefix"]["mean_cached_prompt_tokens"] > res["cold"]["mean_cached_prompt_tokens"]


def test_decode_tput_counts_a_hybrid_stacks_states(qwen3_5_model_dir, tmp_path):
    """A hybrid stack's decode also reads and writes each sequence's linear state: the state bound counts
    batch x 2 x its bytes beside the weights, so it falls below the weights' bound, the more so at 2."""
    decode_tput.main(["--model", str(qwen3_5_model_dir), "--batch-sizes", "1,2", "--prompt-len", "8",
                      "--output-len", "3", "--copy-bytes", str(8 << 20), "--no-hf",
                      "--out", str(tmp_path / "decode_hybrid.json")])  # not out_dir: test_merge's set
    payload = _load(tmp_path / "decode_hybrid.json")
    state, weights = payload["linear_state_bytes_per_sequence"], payload["weight_bytes"]
    assert state > 0
    for r in payload["results"]:
        ratio = r["bound_tokens_per_s"] / r["state_bound_tokens_per_s"]
        assert abs(ratio - (weights + 2 * r["batch"] * state) / weights) < 1e-9


def test_decode_tput(tiny_model_dir, out_dir):
    decode_tput.main(["--model", str(tiny_model_dir), "--batch-sizes", "1,2", "--prompt-len", "8",
                      "--output-len", "4", "--copy-bytes", str(8 << 20),
                      "--out", str(out_dir / "decode.json")])
    payload = _load(out_dir / "decode.json")
    assert payload["weight_bytes"] > 0 and payload["copy_bandwidth_bytes_per_s"] > 0
    assert [r["batch"] for r in payload["results"]] == [1, 2]
    assert payload["linear_state_bytes_per_sequence"] == 0  # no linear layers: no state bound
    assert all(r["state_bound_tokens_per_s"] is None for r in payload["results"])
    for r in payload["results"]:
        assert r["engine_decode_tokens"] == r["batch"] * 3
        assert r["engine_tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0  # counted tokens over a wait
        # HF's rate is a difference of two timings of generate (n tokens less 1): on a loaded host it may
        # come out null (not measurable). Reported either way; never zero, negative or NaN.
        assert _rate(r["hf_tokens_per_s"]) and _rate(r["engine_over_hf"]), r
        assert (r["hf_tokens_per_s"] is None) == (r["engine_over_hf"] is None), r


def _rate(value) -> bool:
    """A rate a benchmark reported: a positive number, or null where its timings could not give one."""
    return value is None or (type(value) in (int, float) and value > 0)


def test_serve_tput(services, tiny_model_dir, out_dir):
    code = serve_tput.main(["--addr", services["on"], "--encoder", services["encoder"],
                            "--model", str(tiny_model_dir), "--num-requests", "6", "--concurrency", "6",
                            "--output-len", "3", "--prompt-len", "8", "--image-size", "32", "--hf-batch", "6",
                            "--out", str(out_dir / "serve_tput.json"), "--no-progress"])
    assert code == 0
    res = _load(out_dir / "serve_tput.json")["results"]
    assert res["served"]["completed"] == 6 and res["hf_generate"]["total_output_tokens"] == 18
    assert res["served_over_hf_output_tps"] > 0
    bound = res["roofline"]
    assert bound["roofline_s"] > 0 and bound["wall_over_roofline"] > 0 and bound["ttft_p99_ms"] > 0
    assert bound["workload"]["requests"] == 6 and bound["vision_flops"] > 0 and bound["decode_steps"] == 2


def test_lookahead(services, tiny_model_dir, out_dir):
    # The benchmark spawns its own decoders, one running request each: a queue forms as soon as two of
    # the 12 requests overlap. (With the module's 8 running, requests that reach the engine one by one
    # from a busy 2-core machine can finish before a queue of 9 ever forms, and lookahead has nothing.)
    code = lookahead.main(["--encoder", services["encoder"], "--model", str(tiny_model_dir),
                           "--decoder-args", " ".join(DECODER_ARGS), "--max-num-seqs", "1",
                           "--num-requests", "12", "--concurrency", "12", "--output-len", "3",
                           "--image-size", "32", "--out", str(out_dir / "lookahead.json"), "--no-progress"])
    assert code == 0
    res = _load(out_dir / "lookahead.json")["results"]
    assert res["off"]["cache"]["images_prefetched"] == 0
    assert res["on"]["cache"]["images_prefetched"] > 0
    assert res["on_over_off_output_tps"] > 0


def test_merge(out_dir, capsys):
    files = sorted(str(p) for p in out_dir.glob("*.json") if p.name != "merged.json")
    assert merge.main([*files, "--out", str(out_dir / "merged.json")]) == 0
    merged = json.loads((out_dir / "merged.json").read_text())
    assert not merged["errors"] and len(merged["benchmarks"]) == len(files) == 8  # one per benchmark above
    assert len(merged["headline"]) > 20 and "headline figures" in capsys.readouterr().out


def test_profile_step_warm_prefill(tiny_model_dir, out_dir):
    """The warm request's prefill step: only the uncached tail is computed (the prompt's last partial
    block and the new tokens), over a cached prefix."""
    profile_step.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                       "--prompt-len", "70", "--warm-tail", "3", "--steps", "2", "--host-top", "40",
                       "--out", str(out_dir / "warm.json")])
    res = _load(out_dir / "warm.json")["results"]
    assert res["prompt_tokens"] > 70 and 3 <= res["tokens_computed"] < 3 + 16
    assert res["wall_ms"] > 0
    # the host's time by function, per step: the engine's own functions among them
    host = res["host_functions"]
    assert len(host) == 40 and all(h["self_ms_per_step"] >= 0 and h["calls_per_step"] > 0 for h in host)
    assert host == sorted(host, key=lambda h: -h["self_ms_per_step"])
    assert any("decoder_svc" in h["function"] or "runner/" in h["function"] or "engine/" in h["function"]
               for h in host)


def test_ttft_by_transport_one_decoder_each(tiny_model_dir, out_dir):
    """bench.ttft --transports: one decoder per transport beside one encoder, each told to ask for its
    own; every cold embedding came the way its decoder asked."""
    from common.transport import nixl as nixl_transport

    asked = ["inline", "shm"] + (["nixl"] if nixl_transport.nixl_installed() else [])
    ttft.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--rounds", "1",
               "--concurrency", "0", "--image-size", "64", "--text-tokens", "20",
               "--transports", ",".join(asked), "--out", str(out_dir / "ttft_transports.json")])
    res = _load(out_dir / "ttft_transports.json")["results"]
    assert list(res["by_transport"]) == asked and set(res["cold_p50_ms_by_transport"]) == set(asked)
    for t in asked:
        came = res["by_transport"][t]["single"]["embedding_transports"]
        # 3 rounds, each image new; each round's follow-up needs its image again (the image ends inside a
        # KV block, so the cached prefix stops before it) and takes the rows its decoder kept: no transport
        assert came == {"inline_data" if t == "inline" else t: 3}


def test_ttft_split_with_the_crossing(tiny_model_dir, out_dir):
    """bench.ttft on the tiny model: cold and warm with the services' split, the inbound crossing read
    from the core's step trace, and a burst against its roofline."""
    ttft.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--rounds", "1",
               "--concurrency", "2", "--image-size", "64", "--text-tokens", "40",
               "--out", str(out_dir / "ttft.json")])
    res = _load(out_dir / "ttft.json")["results"]["single"]
    for case in ("cold", "warm", "followup"):
        split = res[f"{case}_split_ms"]
        assert 0 < split["crossing"] < res[case]["max_ms"]
        assert sum(split.values()) <= res[case]["max_ms"] * 1.05  # service stages + crossing within TTFT
    first = res["first_rounds_ms"]  # the two unmeasured rounds, the decoder's first requests among them
    assert all(len(first[case]) == 2 and min(first[case]) > 0 for case in ("cold", "warm", "followup"))
    floor = res["crossing_floor"]  # the measured round's request through a bare gRPC server, 3 times
    assert floor["n"] == 3 and 0 < floor["min_ms"] <= floor["p50_ms"] and floor["request_bytes"] > 1000


def test_decode_benches_draw_dummy_weights(tiny_model_dir, out_dir):
    """--load-format dummy (run_gpu.sh DECODE_LOAD_FORMAT): the step profile and the in-process side of
    serve_decode run on random language weights drawn on the device, not the checkpoint's."""
    from bench import serve_decode

    profile_step.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                       "--batch", "1", "--steps", "2", "--load-format", "dummy",
                       "--out", str(out_dir / "dummy_profile.json")])
    payload = _load(out_dir / "dummy_profile.json")
    assert payload["config"]["load_format"] == "dummy" and payload["results"]["tokens_per_s"] > 0
    serve_decode.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                       "--batch-sizes", "1", "--output-len", "3", "--repeats", "1", "--engine-only",
                       "--load-format", "dummy", "--out", str(out_dir / "dummy_serve.json")])
    assert _load(out_dir / "dummy_serve.json")["results"]


def test_run_gpu_ttft_section_on_a_cpu(tmp_path):
    """bench/run_gpu.sh's ttft section as a CPU smoke run: one decoder flag in TTFT_DECODER_ARGS reaches
    bench.ttft (a lone "--flag=value" once read as an option of its own), and each preset's JSON comes back
    beside the merge; MPS=1 where no MPS daemon can start says so and runs on."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DEVICE="cpu", DTYPE="float32", SECTIONS="ttft", BUDGET_S="240",
               TTFT_PRESETS="qwen2.5-vl-tiny",
               TTFT_ARGS="--rounds 1 --concurrency 3 --arrival-seconds 0.3 --burst-tokens 2 --image-size 256",
               TTFT_DECODER_ARGS="--kv-cache-bytes=50000000", TTFT_KEEP_MODELS="0", MPS="1",
               PATH=f"{tmp_path}:{os.environ['PATH']}")
    mps = tmp_path / "nvidia-cuda-mps-control"  # a stand-in that fails, as on a host without MPS
    mps.write_text("#!/bin/sh\nexit 1\n")
    mps.chmod(0o755)
    subprocess.run(["bash", str(root / "bench" / "run_gpu.sh")], env=env, check=True, timeout=300,
                   capture_output=True)
    result = json.loads((out / "ttft_qwen2.5-vl-tiny.json").read_text())
    assert result["config"]["decoder_args"] == "--kv-cache-bytes=50000000"
    assert result["results"]["single"]["cold"]["n"] == 1
    burst = result["results"]["burst"]  # three requests arriving over about 0.3 s
    assert burst["ttft"]["n"] == 3 and burst["ttft"]["p99_ms"] >= burst["ttft"]["p50_ms"] > 0
    assert burst["arrival_seconds"] == 0.3 and burst["arrivals_span_ms"] > 0
    assert (out / "results.json").exists()
    assert "MPS: the daemon did not start" in (out / "run_gpu.log").read_text()


def test_poisson_offsets():
    import random

    assert ttft.poisson_offsets(4, 0.0, random.Random(0)) == [0.0] * 4  # at once
    offsets = ttft.poisson_offsets(64, 2.0, random.Random(1))
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(set(offsets)) == 64
    spans = [ttft.poisson_offsets(64, 2.0, random.Random(seed))[-1] for seed in range(200)]
    assert 1.9 < sum(spans) / len(spans) < 2.1  # 63 gaps of mean 2 / 63 s
