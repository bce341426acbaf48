"""Prometheus export of a service's stats record (common/stats.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.stats import stat_fields


class StatsCollector(Collector):
    """Exports a record's stats as Prometheus metrics, reading it at every scrape with `read` (which
    may return None before the first record exists)."""

    def __init__(self, prefix: str, read: Callable[[], Any],
                 registry: CollectorRegistry | None = REGISTRY) -> None:
        self._prefix = prefix
        self._read = read
        self._registry = registry
        if registry is not None:
            registry.register(self)

    def describe(self):
        return []  # names depend on the record: no duplicate check at registration

    def collect(self):
        record = self._read()
        if record is None:
            return
        for f, value in stat_fields(record):
            name = f"{self._prefix}_{f.metadata['metric'] or f.name}"
            doc, kind = f.metadata["doc"], f.metadata["kind"]
            if kind == "counter":
                yield CounterMetricFamily(name, doc, value=value)
            elif kind == "gauge":
                yield GaugeMetricFamily(name, doc, value=value)
            elif kind == "labels":
                family = CounterMetricFamily(name, doc, labels=[f.metadata["label"]])
                for key, count in sorted(value.items()):
                    family.add_metric([key], count)
                yield family
            elif kind == "rows":
                yield from _row_gauges(name, doc, f.metadata["label"], value)

    def close(self) -> None:
        """Unregister from the registry."""
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry = None


def _row_gauges(name: str, doc: str, label: str, rows: list) -> list[GaugeMetricFamily]:
    """One gauge family per numeric column of a "rows" stat, `<name>_<column>`, a sample per row
    labelled with the row's name."""
    if not rows:
        return []
    columns = [f.name for f in dataclasses.fields(rows[0])
               if f.name != "name" and isinstance(getattr(rows[0], f.name), int | float)]
    families = []
    for column in columns:
        family = GaugeMetricFamily(f"{name}_{column}", f"{doc}: {column}", labels=[label])
        for row in rows:
            family.add_metric([row.name], getattr(row, column))
        families.append(family)
    return families
