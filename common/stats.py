"""One stats record per service, read alike by the GetStats RPC, Prometheus and the logs.

A service's record is a dataclass (possibly of dataclasses) whose fields say what they are with `stat`:
a one-line doc and a kind. From that one definition:

- `to_message` fills the API's stats message: every field whose name the message has (the record's
  names are the API's names, so nothing is renamed on the way);
- `StatsCollector` (common/stats_metrics.py) exports every field as `<prefix>_<name>` (or the field's
  own `metric` name): a counter
  (`_total`), a gauge, or a counter family labelled by key for a dict field; "info" fields (strings)
  are left to the RPC; a "rows" field (a list of small records, a repeated message in the API, e.g. one
  row per KV cache group) is one gauge family per numeric column, `<prefix>_<name>_<column>`, labelled
  by the rows' `name`;
- `summary` is the compact line the services log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

KINDS = ("counter", "gauge", "labels", "info", "rows")


def stat(doc: str, kind: str = "counter", default: Any = 0, label: str = "kind", metric: str | None = None
         ) -> Any:
    """A stats field: `kind` is counter (monotonic), gauge, labels (a dict of counters by `label`), info
    (a string for the RPC only) or rows (a list of dataclass rows, each with a `name`; `label` names the
    Prometheus label their name goes in). `metric` names the Prometheus metric when it is not the field's
    name (metrics that existed before the record keep their names)."""
    if kind not in KINDS:
        raise ValueError(f"stat kind must be one of {KINDS}, not {kind!r}")
    meta = {"doc": doc, "kind": kind, "label": label, "metric": metric}
    if kind == "labels":
        return dataclasses.field(default_factory=dict, metadata=meta)
    if kind == "rows":
        return dataclasses.field(default_factory=list, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def stat_fields(record: Any) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, value) for every stat of a record, nested records flattened in order; a nested record
    that is None (a part the service runs without) contributes nothing."""
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if "kind" in f.metadata:
            yield f, value
        elif dataclasses.is_dataclass(value):
            yield from stat_fields(value)
        elif value is not None:
            raise TypeError(f"{type(record).__name__}.{f.name} is neither a stat nor a record")


def as_dict(record: Any) -> dict[str, Any]:
    """The flat {name: value} of a record."""
    return {f.name: value for f, value in stat_fields(record)}


def to_message(record: Any, message_cls: type) -> Any:
    """The API's stats message with every field of the record that it has."""
    names = set(message_cls.DESCRIPTOR.fields_by_name)
    message = message_cls()
    for f, value in stat_fields(record):
        if f.name not in names:
            continue
        if f.metadata["kind"] == "labels":
            getattr(message, f.name).update(value)
        elif f.metadata["kind"] == "rows":  # a repeated message whose fields are the rows' names
            for row in value:
                getattr(message, f.name).add(**dataclasses.asdict(row))
        else:
            setattr(message, f.name, value)
    return message


def summary(record: Any, names: tuple[str, ...]) -> str:
    """`name=value` for the given fields that the record has (a part it runs without has none), for a
    log line."""
    values = as_dict(record)
    return " ".join(f"{name}={values[name]}" for name in names if name in values)
