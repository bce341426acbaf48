"""Configuration as a tree of dataclasses, with the command line generated from it.

Each service's configuration is a dataclass whose fields are its options, or nested dataclasses
(sections) of options. A field becomes a flag when it is declared with `option(...)`: its default, help
text, argparse type and flag name live there and nowhere else. `add_options` adds every option of a
tree to a parser (a section as an argument group); `from_args` builds the tree back from the parsed
namespace. Cross-field rules go in the dataclasses' `__post_init__`, so a config made in code is checked
exactly like one made from flags (a ValueError there is a usage error on the command line).

Flag names follow field names (`max_num_seqs` -> `--max-num-seqs`) unless `flag` says otherwise; the
namespace attribute is the flag's (`--model` -> `args.model`). A bool option is a switch: off by default
it is `store_true`; on by default it needs a `flag` that turns it off (`--no-prefix-caching`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.arg_types import port_number

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, flag: str | None = None,  # noqa: A002 - argparse's word
           type: Callable[[str], Any] | None = None, choices: tuple[str, ...] | None = None,  # noqa: A002
           metavar: str | None = None, aliases: tuple[str, ...] = (), group: str | None = None,
           append: bool = False, default_factory: Callable[[], Any] | None = None,
           nargs: str | None = None) -> Any:
    """A config field that is also a command-line option. No default: the flag is required.
    `group` puts options in a mutually exclusive group of that name; `append` makes a repeatable flag
    whose values collect into a list (default_factory=list); with `nargs="+"` too, one flag may also
    take several values (`--served-model-name a b`)."""
    meta = {"help": help, "flag": flag, "type": type, "choices": choices, "metavar": metavar,
            "aliases": aliases, "group": group, "append": append, "nargs": nargs}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"option": meta})
    return dataclasses.field(default=default, metadata={"option": meta})


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["option"]["flag"] or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return _flag(f).lstrip("-").replace("-", "_")


def _sections(cls: type) -> list[tuple[dataclasses.Field, type]]:
    return [(f, f.metadata["section"][1]) for f in dataclasses.fields(cls) if "section" in f.metadata]


def section(cls: type, title: str) -> Any:
    """A nested config dataclass whose options appear under `title` in --help."""
    return dataclasses.field(default_factory=cls, metadata={"section": (title, cls)})


def add_options(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """Add a flag for every option of `cls` and of its sections."""
    target = parser.add_argument_group(title) if title else parser
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is None:
            continue
        where = target
        if meta["group"]:
            if meta["group"] not in groups:
                groups[meta["group"]] = target.add_mutually_exclusive_group()
            where = groups[meta["group"]]
        kwargs: dict[str, Any] = {"dest": _dest(f), "help": meta["help"] or None}
        default = f.default if f.default is not _MISSING else None
        if isinstance(default, bool):
            kwargs["action"] = "store_false" if default else "store_true"
            if default and not meta["flag"]:
                raise TypeError(f"{cls.__name__}.{f.name}: an option on by default needs a flag that "
                                "turns it off")
        else:
            if meta["append"]:
                kwargs.update(action="extend" if meta["nargs"] else "append", default=[])
                if meta["nargs"]:
                    kwargs["nargs"] = meta["nargs"]
            elif f.default is _MISSING and f.default_factory is _MISSING:
                kwargs["required"] = True
            else:
                kwargs["default"] = default
            for key in ("type", "choices", "metavar"):
                if meta[key] is not None:
                    kwargs[key] = list(meta[key]) if key == "choices" else meta[key]
            if kwargs.get("default") not in (None, []) and kwargs["help"]:
                kwargs["help"] += f" (default: {kwargs['default']})"
        where.add_argument(_flag(f), *meta["aliases"], **kwargs)
    for f, sub in _sections(cls):
        add_options(parser, sub, f.metadata["section"][0])


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The config tree from parsed flags; `overrides` set fields that are not options (or replace
    them). Raises ValueError from a dataclass's own checks."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            value = getattr(args, _dest(f))
            default = f.default if f.default is not _MISSING else None
            if isinstance(default, bool) and default:
                value = bool(value)  # store_false already gives the field's meaning
            values[f.name] = value
    for f, sub in _sections(cls):
        values[f.name] = from_args(sub, args)
    values.update(overrides)
    return cls(**values)


def check_options(config: Any) -> None:
    """Check each option's value with its argparse type, so that a config made in code meets the same
    rules as one made from flags; raises ValueError naming the flag."""
    for f in dataclasses.fields(config):
        meta = f.metadata.get("option")
        value = getattr(config, f.name)
        if meta is None or value is None:
            continue
        values = value if meta["append"] else [value]
        for item in values:
            try:
                if meta["type"] is not None:
                    meta["type"](str(item))
                if meta["choices"] is not None and item not in meta["choices"]:
                    raise argparse.ArgumentTypeError(f"must be one of {', '.join(meta['choices'])}, "
                                                     f"not {item!r}")
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{_flag(f)}: {exc}") from None


@dataclass
class ServiceOptions:
    """What every gRPC service is started with, besides its port (each service has its own default)
    and security (common/security/options.py)."""

    revision: str | None = option(None, "Hub branch, tag or commit for a Hub id --model")
    host: str = option("127.0.0.1", "address to bind")
    metrics_port: int | None = option(None, "Prometheus /metrics port (off if unset)", type=port_number)
    log_level: str = option("INFO", "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        check_options(self)


def add_print_config(parser: argparse.ArgumentParser) -> None:
    """The `--print-config` switch: print the effective configuration as JSON and exit."""
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration (defaults filled in) as JSON and exit")


def config_json(config: Any) -> str:
    """The config tree as indented JSON (paths as strings)."""
    return json.dumps(dataclasses.asdict(config), indent=2, default=str)
