"""The gateway selects an adapter by the request's `model` (as vLLM does) and lists adapters in
/v1/models; `mmserve up --lora-modules` hands them to the decoder and the gateway."""

from __future__ import annotations

import pytest

from common.launcher import build_arg_parser
from gateway.config import GatewayConfig
from tests.gateway.inprocess import fake_decoder, gateway_client

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served():
    with fake_decoder() as (decoder, address), \
            gateway_client(address, lora_modules=["sql=/adapters/sql", "chat"]) as client:
        yield decoder, client


def test_model_name_selects_the_adapter(served):
    decoder, client = served
    for model, adapter in (("sql", "sql"), ("chat", "chat"), ("m", ""), (None, "")):
        body = {"messages": CHAT, "max_tokens": 2} | ({"model": model} if model else {})
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert decoder.requests[-1].lora_adapter == adapter
        assert r.json()["model"] == (adapter or "m")
    r = client.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and decoder.requests[-1].lora_adapter == "sql"


def test_unknown_model_is_404(served):
    decoder, client = served
    r = client.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT})
    assert r.status_code == 404 and "'sql'" in r.json()["error"]["message"]
    assert not decoder.requests


def test_models_lists_the_adapters(served):
    _, client = served
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert set(cards) == {"m", "sql", "chat"}
    assert cards["sql"]["root"] == "/adapters/sql" and cards["sql"]["parent"] == "m"
    assert cards["chat"]["root"] == "chat" and cards["m"]["parent"] is None


def test_adapter_names_must_be_distinct():
    with pytest.raises(ValueError, match="--lora-modules"):
        GatewayConfig(decoders=["x:1"], served_model_names=["m"], lora_modules=["m=/p"])


def test_up_takes_lora_modules():
    args = build_arg_parser().parse_args(["--lora-modules", "a=/x", "b=/y"])
    assert args.lora_modules == ["a=/x", "b=/y"]
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--lora-modules", "no-path"])
