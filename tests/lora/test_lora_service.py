"""Adapters through the decoder service: GenerateRequest.lora_adapter selects one per request, an unknown
name is INVALID_ARGUMENT naming it (the service goes on), GetStats and /metrics count prefix hits per
adapter."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.stats_metrics import StatsCollector
from decoder_svc.engine.engine import EngineStats
from decoder_svc.stats import DecoderStats
from tests.integration.harness import Pair

TEXT = "USER: " + "tell me about the red car and the blue sky " * 3 + "ASSISTANT:"
N = 8


@pytest.fixture(scope="module")
def lora_pair(tiny_model_dir, lora_dirs, tmp_path_factory):
    modules = [f"{name}={path}" for name, path in lora_dirs.items()]
    p = Pair(tiny_model_dir, tmp_path_factory.mktemp("lora-pair"),
             decoder_args=["--num-kv-blocks", "256", "--lora-modules", *modules]).start()
    yield p
    p.stop()


def test_adapter_per_request_and_unknown_name(lora_pair, merged_oracles):
    with lora_pair.decoder_client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text(TEXT, max_tokens=N, lora_adapter="nope")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'nope'" in err.value.details()
        for adapter in ("a1", "", "a2", "a1"):
            result = client.generate_text(TEXT, max_tokens=N, lora_adapter=adapter)
            merged_oracles[adapter].assert_same_tokens(result.token_ids, TEXT, [], N)
        stats = client.stats()
    by_adapter = dict(stats.prefix_cache_hit_tokens_by_adapter)
    assert by_adapter["a1"] > 0 and by_adapter["a2"] == 0 and by_adapter[""] == 0


def test_metrics_label_hits_by_adapter():
    registry = CollectorRegistry()
    record = DecoderStats(EngineStats(prefix_cache_hit_tokens_by_adapter={"a1": 32, "": 0}))
    StatsCollector("mmserve_decoder", lambda: record, registry)
    text = generate_latest(registry).decode()
    assert 'mmserve_decoder_prefix_cache_hit_tokens_by_adapter_total{adapter="a1"} 32.0' in text


def test_cli_generate_names_an_adapter(lora_pair):
    from tests.cli_errors import run_cli

    address = lora_pair.decoder.address
    ok = run_cli("generate", "--addr", address, "--prompt", "USER: hi ASSISTANT:", "--max-tokens", "4",
                 "--lora-adapter", "a2", timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = run_cli("generate", "--addr", address, "--prompt", "hi", "--lora-adapter", "nope", timeout=120)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "'nope'" in bad.stderr
