"""Fixtures: one encoder+decoder pair per module, gateways in front of it, the official OpenAI client."""

from __future__ import annotations

import pytest
from openai import OpenAI

from bench.services import free_port
from tests.gateway.harness import GatewayProcess
from tests.integration.harness import Pair

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    p = Pair(tiny_model_dir, tmp_path_factory.mktemp("pair"),
             decoder_args=["--num-kv-blocks", "512", "--max-num-batched-tokens", "64"]).start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def gateway(pair, tmp_path_factory):
    """Two API keys (two tenants), no tokenizer (logprob tokens read `token_id:N`), defaults otherwise."""
    g = GatewayProcess([pair.decoder.address], tmp_path_factory.mktemp("gw") / "gateway.log",
                       ["--served-model-name", "tiny", "--api-key", KEY_A, "--api-key", KEY_B]).start()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def open_gateway(pair, tiny_model_dir, tmp_path_factory):
    """No authentication, private image URLs allowed, a 100 kB image limit, the tokenizer loaded, and a
    dead decoder listed first (requests must still reach the live one)."""
    g = GatewayProcess([f"127.0.0.1:{free_port()}", pair.decoder.address],
                       tmp_path_factory.mktemp("gw") / "gateway.log",
                       ["--model", str(tiny_model_dir), "--served-model-name", "tiny",
                        "--allow-private-image-urls", "--max-image-bytes", "100000"]).start()
    yield g
    g.stop()


def openai_client(gateway: GatewayProcess, api_key: str = KEY_A, **kwargs) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def client(gateway) -> OpenAI:
    return openai_client(gateway)
