"""The decoder told which embedding transports to ask for (`--embedding-transports`): an encoder on this
host that offers shared memory and NIXL hands out what the decoder asked for first, tokens still equal
HF's and nothing is left held; a transport the decoder cannot read is refused before its model loads."""

from __future__ import annotations

import pytest

from common.transport import nixl as nixl_transport
from tests.cli_errors import assert_usage_error, run_cli
from tests.integration.conftest import png
from tests.integration.harness import Pair

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
N = 8


def _served(pair: Pair, oracle, images) -> dict[str, int]:
    with pair.decoder_client(timeout=300) as client:
        for image in images:
            result = client.generate_text(PROMPT, [png(image)], max_tokens=N)
            oracle.assert_same_tokens(result.token_ids, PROMPT, [image], N)
        transports = dict(client.stats().embedding_transports)
    dec, enc = pair.wait_idle()
    assert dec.kv_blocks_used == 0 and dec.active_leases == 0 and enc.active_leases == 0
    return transports


@pytest.mark.parametrize("asked, encoder_args", [
    ("inline", []),
    pytest.param("nixl", ["--nixl"], marks=pytest.mark.skipif(
        not nixl_transport.nixl_installed(), reason="the nixl extra is not installed")),
])
def test_the_decoder_gets_the_transport_it_asks_for(asked, encoder_args, tiny_model_dir, tmp_path, oracle,
                                                    test_images):
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=encoder_args,
                decoder_args=["--embedding-transports", asked, "--max-num-batched-tokens", "64"]).start()
    try:
        assert f"transports {asked}" in pair.decoder.log_tail(200)  # the ready line: asked, then inline
        if asked == "nixl":  # its agent started with the decoder, not on the first request
            assert "Initialized NIXL agent: mmserve-dec-" in pair.decoder.log_tail(200)
        transports = _served(pair, oracle, test_images[:2])
        assert transports == {"inline_data" if asked == "inline" else asked: 2}
    finally:
        pair.stop()


def test_a_transport_it_cannot_read_is_refused_before_the_model_loads(tiny_model_dir):
    result = run_cli("decoder", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0",
                     "--encoder", "127.0.0.1:1", "--embedding-transports", "cuda_ipc,shm")
    assert_usage_error(result, "--embedding-transports", "'cuda_ipc' cannot be read here")
