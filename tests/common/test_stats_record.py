"""The one stats record per service: every API field comes from it, and /metrics exports each field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.pb import decoder_pb2, encoder_pb2
from common.stats import as_dict, stat, summary, to_message
from common.stats_metrics import StatsCollector
from decoder_svc.encoders.source_stats import RemoteSourceStats
from decoder_svc.engine.engine import EngineStats
from decoder_svc.engine.kv_cache_manager import KvGroupStats
from decoder_svc.engine.ttft_stages import FirstTokenStats
from decoder_svc.stats import DecoderStats
from encoder_svc.stats import EncoderStats

GROUPS = [KvGroupStats("full", 0, 3, 10, 2), KvGroupStats("sliding_16", 16, 1, 6, 4)]


def _decoder_record() -> DecoderStats:
    special = {"kv_groups": GROUPS, "prefix_cache_hit_tokens_by_adapter": {"": 2, "sql": 5}}
    numbers = {name: i + 1 for i, name in enumerate(as_dict(EngineStats())) if name not in special}
    engine = EngineStats(**numbers, **special)
    source = RemoteSourceStats(active_leases=2, images_prefetched=5, embedding_transports={"shm": 3},
                               encoders=4)
    return DecoderStats(engine, source, FirstTokenStats({"input": 0.5, "prefill": 2.0}, 3))


def test_every_field_of_the_decoder_stats_message_comes_from_the_record():
    record = _decoder_record()
    message = to_message(record, decoder_pb2.DecoderStats)
    values = as_dict(record)
    for name in decoder_pb2.DecoderStats.DESCRIPTOR.fields_by_name:
        assert name in values, f"DecoderStats.{name} has no field in the service's stats record"
        got = getattr(message, name)
        if name == "kv_groups":  # a repeated message, one per row
            got = [KvGroupStats(g.name, g.window, g.blocks_used, g.blocks_total, g.blocks_cached_free)
                   for g in got]
        maps = ("embedding_transports", "ttft_stage_seconds", "prefix_cache_hit_tokens_by_adapter")
        assert (dict(got) if name in maps else got) == values[name]


def test_the_metrics_export_every_stat_under_its_own_name():
    registry = CollectorRegistry()
    StatsCollector("mmserve_decoder", _decoder_record, registry)
    text = generate_latest(registry).decode()
    assert "mmserve_decoder_running 1.0" in text  # a gauge
    assert "mmserve_decoder_preemptions_total" in text  # a counter
    assert 'mmserve_decoder_embedding_transports_total{transport="shm"} 3.0' in text
    assert 'mmserve_decoder_prefix_cache_hit_tokens_by_adapter_total{adapter="sql"} 5.0' in text
    assert "mmserve_decoder_encoders 4.0" in text
    assert "mmserve_decoder_active_leases 2.0" in text
    # rows: a gauge family per column, labelled by group
    assert 'mmserve_decoder_kv_groups_blocks_used{group="sliding_16"} 1.0' in text
    assert 'mmserve_decoder_kv_groups_blocks_total{group="full"} 10.0' in text
    assert 'mmserve_decoder_kv_groups_window{group="sliding_16"} 16.0' in text


def test_a_record_without_its_source_part_still_exports_and_answers():
    record = DecoderStats(EngineStats(waiting=3))
    assert to_message(record, decoder_pb2.DecoderStats).waiting == 3
    assert "waiting=3" in record.log_line()


def test_a_field_that_is_not_a_stat_is_refused():
    @dataclass
    class Bad:
        ok: int = stat("fine")
        oops: int = 0

    with pytest.raises(TypeError, match="oops"):
        summary(Bad(), ("ok",))
    with pytest.raises(ValueError, match="kind"):
        stat("x", "histogram")


def test_every_field_of_the_encoder_stats_message_comes_from_the_record():
    record = EncoderStats(hits=3, entries=2, images_per_s=1.5, model_fingerprint="fp", device="cpu")
    message = to_message(record, encoder_pb2.EncoderStats)
    values = as_dict(record)
    for name in encoder_pb2.EncoderStats.DESCRIPTOR.fields_by_name:
        assert name in values, f"EncoderStats.{name} has no field in the service's stats record"
        assert getattr(message, name) == values[name]


def test_encoder_metrics_keep_their_names():
    registry = CollectorRegistry()
    StatsCollector("mmserve_encoder", lambda: EncoderStats(hits=3, entries=2, device="cpu"), registry)
    text = generate_latest(registry).decode()
    assert "mmserve_encoder_cache_hits_total 3.0" in text and "mmserve_encoder_cache_entries 2.0" in text
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    for info in ("device", "model_fingerprint", "transports"):  # info fields are the RPC's only
        assert not {f"mmserve_encoder_{info}", f"mmserve_encoder_{info}_info"} & names
