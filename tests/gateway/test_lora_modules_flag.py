"""The gateway's --lora-modules: vLLM's JSON form is taken (its base_model_name the card's parent), and a
name given twice (`ad1 ad1`, or two JSON items of one name) is refused at start with one line."""

from __future__ import annotations

import json

import pytest

from common.lora_modules import LoRAModule
from gateway import main as gateway_main
from gateway.config import GatewayConfig
from gateway.main import main
from tests.gateway.inprocess import fake_decoder, gateway_client


@pytest.fixture(autouse=True)
def never_serve(monkeypatch):
    """A start the flags should have refused fails the test rather than serving until the timeout."""
    def serve(config):
        raise AssertionError(f"the gateway would start with --lora-modules {config.lora_modules}")

    monkeypatch.setattr(gateway_main, "serve", serve)


SQL = json.dumps({"name": "sql", "path": "/adapters/sql", "base_model_name": "base-m"})


def test_vllms_json_form_is_served_and_listed():
    with fake_decoder() as (decoder, address), gateway_client(
            address, lora_modules=[SQL, json.dumps({"name": "chat", "path": "/adapters/chat"})]) as client:
        cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
        assert cards["sql"]["root"] == "/adapters/sql" and cards["sql"]["parent"] == "base-m"
        assert cards["chat"]["parent"] == "m"
        reply = client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
        assert reply.status_code == 200 and decoder.requests[-1].lora_adapter == "sql"
    config = GatewayConfig(decoders=["x:1"], served_model_names=["m"], lora_modules=[SQL, "b=/p", "c"])
    assert list(config.lora_adapters.values()) == [
        LoRAModule("sql", "/adapters/sql", "base-m"), LoRAModule("b", "/p"), LoRAModule("c")]


@pytest.mark.parametrize("items", [
    ["ad1", "ad1"],
    ["ad1=/a", "ad1=/b"],
    [SQL, json.dumps({"name": "sql", "path": "/other"})],
    [SQL, "sql"],
])
def test_a_name_given_twice_is_refused_at_start_in_one_line(items, capsys):
    with pytest.raises(ValueError, match="given twice"):
        GatewayConfig(decoders=["x:1"], served_model_names=["m"], lora_modules=items)
    assert main(["--decoder", "127.0.0.1:1", "--lora-modules", *items]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "given twice" in err and "Traceback" not in err


@pytest.mark.parametrize("item, words", [
    ('{"name": "x"}', "path"),
    ('{"name": "", "path": "/p"}', "name"),
    ('{"name": "x", "path": "/p", "rank": 8}', "unknown key"),
    ('{"name": "x", "path": 7}', "path"),
    ('["x"]', "JSON object"),
    ('{"name": ', "not valid JSON"),
])
def test_a_malformed_json_item_is_one_line_naming_it(item, words, capsys):
    assert main(["--decoder", "127.0.0.1:1", "--lora-modules", item]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "--lora-modules" in err
