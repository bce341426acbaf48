"""Merge benchmark JSON files into one, with a headline table of the figures BENCHMARKS.md lists.

    python -m bench.merge RESULTS_DIR/*.json --out results.json

The table has the rows picked here from the benchmarks this module knows by name (FIXED), then the rows
of any other payload that carries its own `headline` ([figure, value] pairs: bench.qwen_gpu for
Qwen2.5-VL and Qwen3-VL, bench.qwen_serve, ...), in file order.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from bench.report import fmt, print_table
from bench.stats import clean


def _get(d: dict | None, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


# Benchmarks whose rows headline() picks itself; any other payload's own `headline` rows are appended.
FIXED = frozenset({"handoff", "encode_cache", "ttft_prefix", "decode_tput", "serve_decode",
                   "serve_decode_fp8", "fp8_accuracy", "serve_tput", "lookahead", "serve"})


def payload_headline(payload: dict) -> list[list]:
    """A payload's own `headline`: its well-formed [figure, value] rows (others are skipped)."""
    rows = payload.get("headline") if isinstance(payload, dict) else None
    if not isinstance(rows, list):
        return []
    return [[str(r[0]), r[1]] for r in rows if isinstance(r, (list, tuple)) and len(r) == 2]


def headline(benchmarks: dict[str, dict]) -> list[list]:
    """[figure, value] rows from whichever benchmarks are present."""
    rows: list[list] = []
    h = _get(benchmarks, "handoff", "results") or []
    for r in h:
        if "error" in r:
            rows.append([f"handoff {r['encoder']}", "failed to start"])
            continue
        rows.append([f"handoff {r['transport']} ({r['encoder']}, {r['nbytes']} B) p50 ms",
                     _get(r, "total", "p50_ms")])
        rows.append([f"handoff {r['transport']} first call ms", r.get("first_call_ms")])
    e = _get(benchmarks, "encode_cache", "results")
    if e:
        rows += [[f"Encode {k} p50 ms", _get(e, k, "p50_ms")] for k in ("miss", "hit_bytes", "hit_hash")]
        rows.append(["Encode miss/hit p50 ratio", e.get("miss_over_hit_p50")])
    t = _get(benchmarks, "ttft_prefix", "results")
    if t:
        rows += [[f"TTFT {k} p50 ms", _get(t, k, "p50_ms")]
                 for k in ("cold", "warm_prefix", "image_cached_new_text")]
        rows.append(["TTFT cold/warm p50 ratio", t.get("cold_over_warm_p50")])
    decode_rows = _get(benchmarks, "decode_tput", "results") or []
    both_merges = len({r.get("merge_builtin_adapter") for r in decode_rows}) > 1  # both modes ran
    for r in decode_rows:
        merged = "on" if r.get("merge_builtin_adapter") else "off"
        b = f"{r['batch']} (adapter merged {merged})" if both_merges else r["batch"]
        rows += [[f"decode tok/s batch {b}: engine", r["engine_tokens_per_s"]],
                 [f"decode tok/s batch {b}: HF generate", r["hf_tokens_per_s"]],
                 [f"decode batch {b}: engine/HF", r["engine_over_hf"]],
                 [f"decode batch {b}: engine/bandwidth bound", r["engine_fraction_of_bound"]]]
    decodes = (("serve_decode", "bf16"), ("serve_decode_fp8", "fp8"), ("serve_decode_tp2", "bf16 TP=2"))
    for name, label in decodes:
        for r in _get(benchmarks, name, "results") or []:
            b = r["batch"]
            rows += [[f"decode tok/s batch {b} ({label}): through gRPC", r["served_tokens_per_s"]],
                     [f"decode tok/s batch {b} ({label}): in-process engine", r["engine_tokens_per_s"]],
                     [f"decode batch {b} ({label}): gRPC/in-process", r["served_over_engine"]]]
    acc = _get(benchmarks, "fp8_accuracy", "results")
    if acc:
        per_layer = acc.get("per_layer_relative_error") or [None]
        rows += [["FP8 vs bf16 teacher-forced top-1 agreement", acc.get("top1_agreement")],
                 ["FP8 vs bf16 last-layer hidden rel. error", per_layer[-1]]]
    s = _get(benchmarks, "serve_tput", "results")
    if s:
        tps = "output_token_throughput_tps"
        rows += [["serve 64 conc.: output tok/s", _get(s, "served", tps)],
                 ["serve 64 conc.: HF batched output tok/s", _get(s, "hf_generate", tps)],
                 ["serve 64 conc.: mmserve/HF", s.get("served_over_hf_output_tps")],
                 ["serve 64 conc.: wall / roofline", _get(s, "roofline", "wall_over_roofline")],
                 ["serve 64 conc.: TTFT p99 ms", _get(s, "served", "ttft", "p99_ms")],
                 ["serve 64 conc.: prefix-cache hit rate",
                  _get(s, "served", "cache", "prefix_cache_hit_rate")],
                 ["serve 64 conc.: encoder-cache hit rate",
                  _get(s, "served", "cache", "encoder_cache_hit_rate")]]
    la = _get(benchmarks, "lookahead", "results")
    if la:
        rows += [["lookahead on/off output tok/s", la.get("on_over_off_output_tps")],
                 ["lookahead on/off TTFT mean", la.get("on_over_off_ttft_mean")]]
    sv = _get(benchmarks, "serve", "results")
    if sv:
        rows += [["bench.serve output tok/s", sv.get("output_token_throughput_tps")],
                 ["bench.serve TTFT p50 / p99 ms",
                  f"{fmt(_get(sv, 'ttft', 'p50_ms'))} / {fmt(_get(sv, 'ttft', 'p99_ms'))}"],
                 ["bench.serve TPOT p50 ms", _get(sv, "tpot", "p50_ms")],
                 ["bench.serve prefix-cache hit rate", _get(sv, "cache", "prefix_cache_hit_rate")],
                 ["bench.serve images skipped by KV reuse", _get(sv, "cache", "images_skipped_by_kv_reuse")]]
    for name, payload in benchmarks.items():
        if name not in FIXED:
            rows += payload_headline(payload)
    return rows


def merge(paths: Sequence[str | Path]) -> dict:
    """{"benchmarks": {name: payload}, "headline": rows}; unreadable files are listed under "errors"."""
    benchmarks: dict[str, dict] = {}
    errors = []
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
            benchmarks[payload.get("benchmark", Path(path).stem)] = payload
        except (OSError, ValueError) as exc:
            errors.append(f"{path}: {exc}")
    return {"benchmarks": benchmarks, "headline": headline(benchmarks), "errors": errors}


def main(argv: Sequence[str] | None = None) -> int:
    """Merge the given files, print the headline table, write --out."""
    p = argparse.ArgumentParser(prog="python -m bench.merge", description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    merged = merge(args.files)
    print_table("headline figures", ["figure", "value"], merged["headline"])
    Path(args.out).write_text(json.dumps(clean(merged), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
