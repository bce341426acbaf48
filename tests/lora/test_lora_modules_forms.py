"""--lora-modules takes the same forms on the decoder, the gateway and `mmserve up` (common/lora_modules.py):
`NAME=PATH` and vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`; a name given twice
is refused at start with one line, before anything loads or starts."""

from __future__ import annotations

import json

import pytest

from common import launcher
from common.lora_modules import adapter_paths, lora_modules_by_name
from decoder_svc.engine import EngineConfig
from decoder_svc.main import main as decoder_main

SQL = json.dumps({"name": "sql", "path": "/adapters/sql", "base_model_name": "base-m"})
CHAT = json.dumps({"name": "chat", "path": "/adapters/chat"})


def _decoder(model_dir, *lora_modules: str) -> int:
    """The decoder's main up to --print-config (its flags checked, nothing loaded or contacted)."""
    return decoder_main(["--model", str(model_dir), "--encoder", "127.0.0.1:1", "--lora-modules",
                         *lora_modules, "--print-config"])


def _one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert lines and "Traceback" not in err
    assert all(n in lines[-1] for n in needles), lines[-1]


def test_the_decoder_takes_vllms_json_form(tiny_model_dir, capsys):
    config = EngineConfig(model=tiny_model_dir, lora_modules=[SQL, "b=/p", CHAT])
    assert config.lora_adapters == {"sql": "/adapters/sql", "b": "/p", "chat": "/adapters/chat"}
    assert _decoder(tiny_model_dir, SQL, "b=/p") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["engine"]["lora_modules"] == [SQL, "b=/p"]
    # the gateway reads the same items to the same names
    assert list(lora_modules_by_name([SQL, "b=/p", CHAT])) == list(config.lora_adapters)


@pytest.mark.parametrize("items", [[SQL, "sql=/other"], ["a=/x", "a=/x"], [CHAT, CHAT]])
def test_the_decoder_refuses_a_name_given_twice(tiny_model_dir, items, capsys):
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig(model=tiny_model_dir, lora_modules=items)
    assert _decoder(tiny_model_dir, *items) == 2
    _one_line(capsys.readouterr().err, "given twice")


@pytest.mark.parametrize("item, words", [
    ('{"name": "x"}', "path"),
    ('{"name": "x", "path": "/p", "rank": 8}', "unknown key"),
    ('{"name": ', "not valid JSON"),
    ("x", "NAME=PATH"),
])
def test_the_decoder_refuses_a_malformed_item_in_one_line(tiny_model_dir, item, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        _decoder(tiny_model_dir, item)
    assert exit_.value.code == 2
    _one_line(capsys.readouterr().err, "--lora-modules", words)


def test_up_takes_vllms_json_form():
    args = launcher.build_arg_parser().parse_args(["--lora-modules", SQL, "b=/p"])
    assert args.lora_modules == [SQL, "b=/p"]  # handed to the decoder and the gateway as given
    assert adapter_paths(args.lora_modules) == {"sql": "/adapters/sql", "b": "/p"}


@pytest.mark.parametrize("items", [[SQL, "sql=/other"], ["a=/x", "a=/y"]])
def test_up_refuses_a_name_given_twice_before_starting_anything(monkeypatch, items, capsys):
    def start(*args, **kwargs):
        raise AssertionError("mmserve up went on past a name given twice")

    monkeypatch.setattr(launcher, "check_port_free", start)
    monkeypatch.setattr(launcher, "_spawn", start)
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["--lora-modules", *items])
    assert exit_.value.code == 2
    _one_line(capsys.readouterr().err, "--lora-modules", "given twice")
