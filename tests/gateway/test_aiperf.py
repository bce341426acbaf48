"""NVIDIA's aiperf against the running stack (gateway, decoder, encoder on the tiny model): streamed
chat with synthetic images and per-chunk usage; every request succeeds with all its tokens, and none
gets its first token with its last (about 70 s on 2 busy CPU cores).

aiperf is not a dependency of mmserve: installed beside it, aiperf 0.13.0 would downgrade packages the
project runs on (huggingface_hub 2.x to 1.x, pillow, prometheus-client, rich) and pull in some 70 more.
It runs from its own virtualenv instead; this test finds it through MMSERVE_AIPERF (the aiperf
executable) or PATH, and is skipped without it:

    python -m venv ~/.venvs/aiperf && ~/.venvs/aiperf/bin/pip install aiperf==0.13.0
    MMSERVE_AIPERF=~/.venvs/aiperf/bin/aiperf pytest tests/gateway/test_aiperf.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.gateway.harness import GatewayProcess

AIPERF = os.environ.get("MMSERVE_AIPERF") or shutil.which("aiperf")
REQUESTS, OUTPUT_TOKENS = 12, 16

pytestmark = pytest.mark.skipif(AIPERF is None, reason="aiperf not found (MMSERVE_AIPERF or PATH)")


@pytest.fixture(scope="module")
def tokenizer_gateway(pair, tiny_model_dir, tmp_path_factory):
    g = GatewayProcess([pair.decoder.address], tmp_path_factory.mktemp("gw") / "gateway.log",
                       ["--model", str(tiny_model_dir), "--served-model-name", "tiny"]).start()
    yield g
    g.stop()


def test_aiperf_streamed_chat_with_images(tokenizer_gateway, tiny_model_dir, tmp_path):
    out = tmp_path / "aiperf"
    argv = [AIPERF, "profile", "--model", "tiny", "--url", tokenizer_gateway.url, "--endpoint-type", "chat",
            "--streaming", "--per-chunk-usage", "--use-server-token-count",  # aiperf: the one needs the other
            "--tokenizer", str(tiny_model_dir),
            "--request-count", str(REQUESTS), "--concurrency", "2", "--warmup-request-count", "1",
            "--prompt-input-tokens-mean", "24", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{OUTPUT_TOKENS}",
            "--image-width-mean", "40", "--image-height-mean", "40", "--image-batch-size", "1",
            "--image-format", "png", "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics",
            "--workers-max", "1", "--output-artifact-dir", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    lines = next(out.rglob("profile_export.jsonl")).read_text().splitlines()
    records = [r for r in map(json.loads, filter(None, lines))
               if r["metadata"]["benchmark_phase"] != "warmup"]
    assert summary["request_count"]["avg"] == REQUESTS, summary.get("error_request_count")
    assert not summary.get("error_request_count"), summary["error_request_count"]
    assert len(records) == REQUESTS
    for record in records:
        metrics = record["metrics"]
        assert metrics["output_sequence_length"]["value"] == OUTPUT_TOKENS
        # The first token reaches the client before the last one: no burst of the whole generation.
        assert metrics["time_to_first_token"]["value"] < metrics["request_latency"]["value"]
