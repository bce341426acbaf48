"""bench.soak on qwen2.5-vl-tiny, CPU: a few clients for a few seconds through a real pair, every check
passing; and the checks themselves fail on what they must catch (held KV blocks or leases, an unexpected
status, a changed reference, a dead service). Starts services: slow (tests/markers.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest

from bench import soak
from common.pb import decoder_pb2

IDLE_DECODER = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "active_leases": 0}
IDLE_ENCODER = {"active_leases": 0, "leased_bytes": 0}
LIMITS = SimpleNamespace(max_rss_growth_mib=512.0, max_gpu_growth_mib=2048.0, deterministic=False)
DETERMINISTIC = SimpleNamespace(**{**vars(LIMITS), "deterministic": True})


def test_leak_checks_pass_when_idle():
    checks = soak.leak_checks(IDLE_DECODER, IDLE_ENCODER)
    assert checks and all(checks.values())


@pytest.mark.parametrize("service, field", [("decoder", f) for f in IDLE_DECODER]
                         + [("encoder", f) for f in IDLE_ENCODER])
def test_leak_checks_fail_on_anything_held(service, field):
    dec, enc = dict(IDLE_DECODER), dict(IDLE_ENCODER)
    (dec if service == "decoder" else enc)[field] = 3
    checks = soak.leak_checks(dec, enc)
    assert checks[f"{service}_{field}_0"] is False
    assert soak.exit_code(checks) == 1


def test_leak_checks_fail_on_missing_stats():
    assert soak.exit_code(soak.leak_checks({}, {})) == 1


def _passing_result() -> dict:
    """A result whose every check passes (as a clean run leaves it)."""
    ok = {"ok": 5, "cancelled": 1, "refused": 2, "unexpected": 0}
    tokens = list(range(soak.REFERENCE_TOKENS))
    return {"load": {"by_outcome": ok, "hostile_cases_refused": ["nan_temperature"]},
            "warmup": {"by_outcome": dict(ok)},
            "workload": {"hostile_cases": ["nan_temperature"]},
            "reference": {"before": tokens, "after_cold": list(tokens), "after_warm": list(tokens),
                          "warm_matches": True, "logprobs_match": {"after_cold": True, "after_warm": True}},
            "encoder_counters": {"expired_leases": 0},
            "idle_after": {"checks": soak.leak_checks(IDLE_DECODER, IDLE_ENCODER)},
            "memory_growth": {"decoder": {"rss_anon_tree_mib": 10.0}, "encoder": {"rss_anon_tree_mib": 5.0}}}


ALIVE = {"decoder": True, "encoder": True}


def test_checks_pass_on_a_clean_result():
    checks = soak.checks_of(_passing_result(), LIMITS, ALIVE)
    assert soak.exit_code(checks) == 0, checks


@pytest.mark.parametrize("name, spoil", [
    ("no_unexpected_status", lambda r: r["load"]["by_outcome"].update(unexpected=1)),
    ("no_unexpected_status", lambda r: r["warmup"]["by_outcome"].update(unexpected=1)),
    ("reference_tokens_identical", lambda r: r["reference"]["after_cold"].__setitem__(3, -1)),
    ("reference_tokens_identical", lambda r: r["reference"].pop("after_cold")),
    ("decoder_kv_blocks_used_0", lambda r: r["idle_after"]["checks"].update(decoder_kv_blocks_used_0=False)),
    ("decoder_kv_blocks_used_0", lambda r: r.pop("idle_after")),
    ("no_expired_leases", lambda r: r["encoder_counters"].update(expired_leases=2)),
    ("hostile_cases_all_refused", lambda r: r["load"].update(hostile_cases_refused=[])),
    ("requests_served", lambda r: r["load"]["by_outcome"].update(ok=0)),
    ("decoder_rss_growth_ok", lambda r: r["memory_growth"]["decoder"].update(rss_anon_tree_mib=4096.0)),
    ("encoder_rss_growth_ok", lambda r: r["memory_growth"]["encoder"].pop("rss_anon_tree_mib")),
    ("memory_measured", lambda r: r.pop("memory_growth")),
    ("no_error", lambda r: r.update(error="TimeoutError: ")),
])
def test_checks_fail_on_a_spoiled_result(name, spoil):
    result = _passing_result()
    spoil(result)
    checks = soak.checks_of(result, LIMITS, ALIVE)
    assert checks[name] is False
    assert soak.exit_code(checks) == 1


@pytest.mark.parametrize("name, spoil", [
    ("reference_warm_tokens_identical", lambda r: r["reference"].update(warm_matches=False)),
    ("reference_logprobs_identical", lambda r: r["reference"]["logprobs_match"].update(after_warm=False)),
    ("reference_logprobs_identical", lambda r: r["reference"].pop("logprobs_match")),
])
def test_the_deterministic_mode_checks_the_warm_run_and_the_logprobs(name, spoil):
    result = _passing_result()
    assert soak.exit_code(soak.checks_of(result, DETERMINISTIC, ALIVE)) == 0
    spoil(result)
    assert soak.exit_code(soak.checks_of(result, LIMITS, ALIVE)) == 0  # outside the mode: not promised
    checks = soak.checks_of(result, DETERMINISTIC, ALIVE)
    assert checks[name] is False and soak.exit_code(checks) == 1


def test_a_dead_service_fails():
    checks = soak.checks_of(_passing_result(), LIMITS, {"decoder": False, "encoder": True})
    assert checks["services_alive"] is False and soak.exit_code(checks) == 1


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"a {self._code.name}"


def _classify(kind: str, exc: BaseException | None = None, finish: int = 0, hung_up: bool = False):
    async def run():
        fut = asyncio.get_running_loop().create_future()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(None)
        stream = soak._Stream(0.0, finish_reason=finish)
        job = soak.Job(kind, decoder_pb2.GenerateRequest(), case="c" if kind == "hostile" else "")
        return soak.classify(job, stream, fut, hung_up)

    return asyncio.run(run()).outcome


def test_classify():
    stop = decoder_pb2.FINISH_REASON_STOP
    assert _classify("image", finish=stop) == "ok"
    assert _classify("image", finish=decoder_pb2.FINISH_REASON_ABORT) == "unexpected"
    assert _classify("image", _RpcError(grpc.StatusCode.INVALID_ARGUMENT)) == "unexpected"
    assert _classify("hostile", _RpcError(grpc.StatusCode.INVALID_ARGUMENT)) == "refused"
    assert _classify("hostile", _RpcError(grpc.StatusCode.NOT_FOUND)) == "refused"
    assert _classify("hostile", _RpcError(grpc.StatusCode.INTERNAL)) == "unexpected"
    assert _classify("hostile", _RpcError(grpc.StatusCode.UNKNOWN)) == "unexpected"
    assert _classify("hostile", finish=stop) == "unexpected"  # served: not refused
    assert _classify("text", _RpcError(grpc.StatusCode.CANCELLED), hung_up=True) == "cancelled"
    assert _classify("text", _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED)) == "unexpected"


def test_soak_smoke_cpu(qwen_model_dir, tmp_path):
    """Through a real pair (the deterministic mode's end-to-end promise is
    tests/integration/test_deterministic_pair.py's; its soak checks are tested above)."""
    out = tmp_path / "soak.json"
    rc = soak.main(["--model", str(qwen_model_dir), "--device", "cpu", "--dtype", "float32",
                    "--clients", "3", "--seconds", "4", "--warmup-seconds", "1", "--max-image-size", "256",
                    "--hot-images", "4", "--clips", "2", "--clip-seconds", "1", "--clip-size", "64",
                    "--request-timeout", "60", "--idle-timeout", "15", "--start-timeout", "120",
                    "--logs", str(tmp_path / "logs"), "--out", str(out)])
    payload = json.loads(out.read_text())
    res = payload["results"]
    assert payload["benchmark"] == "qwen_soak" and payload["env"]["device"] == "cpu"
    assert rc == 0, {k: v for k, v in res["checks"].items() if not v}
    assert all(res["checks"].values())
    load = res["load"]
    assert load["by_outcome"]["ok"] > 0 and load["by_outcome"]["unexpected"] == 0
    assert set(load["hostile_cases_refused"]) == set(soak.HOSTILE_CASES)  # truncated_video too
    assert load["ttft"]["n"] > 0 and load["tokens_per_s"] > 0
    assert len(res["reference"]["before"]) == soak.REFERENCE_TOKENS
    assert len(res["reference"]["logprobs_before"]) == soak.REFERENCE_TOKENS
    assert res["idle_after"]["decoder"]["kv_blocks_used"] == 0
    # The same run, had the decoder kept KV blocks after going idle, fails.
    held = {**res["idle_after"]["decoder"], "kv_blocks_used": 2}
    res["idle_after"]["checks"] = soak.leak_checks(held, res["idle_after"]["encoder"])
    assert soak.exit_code(soak.checks_of(res, LIMITS, ALIVE)) == 1
