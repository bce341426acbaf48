"""SIGTERM drains the decoder: NOT_SERVING, new requests UNAVAILABLE ("shutting down"), in-flight
streams run to completion within --drain-timeout, and past it end with a clear UNAVAILABLE."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from common.client import DecoderClient
from tests.integration.harness import Pair

LONG = "USER: Tell me everything about the sea. ASSISTANT:"


def _stream_in_thread(address: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        try:
            with DecoderClient(address, timeout=240) as client:
                chunks = list(client.generate(LONG, max_tokens=max_tokens, ignore_eos=True))
            result["tokens"] = sum(len(c.token_ids) for c in chunks)
            result["finish"] = chunks[-1].finish_reason
        except grpc.RpcError as exc:
            result["error"] = (exc.code(), exc.details())

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_running(client: DecoderClient) -> None:
    deadline = time.monotonic() + 30
    while client.stats().running == 0:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)


# 90 s: the 600 tokens take seconds, but a loaded 2-core CI machine once needed more than 30
@pytest.mark.parametrize("drain_timeout, completes", [(90.0, True), (0.3, False)])
def test_sigterm_drains_in_flight_streams(tiny_model_dir, tmp_path, drain_timeout, completes):
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=["--drain-timeout", str(drain_timeout)]).start()
    try:
        thread, result = _stream_in_thread(pair.decoder.address, max_tokens=600)
        with pair.decoder_client() as client:
            _wait_running(client)
            pair.decoder.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            with pytest.raises(grpc.RpcError) as err:  # new work is refused during the drain
                client.generate_text("USER: hi ASSISTANT:", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            # Retry info for gRPC clients (issue 67): gRPC's pushback trailer.
            assert dict(err.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"
        thread.join(drain_timeout + 60)
        if completes:
            assert result.get("tokens") == 600, result
        else:
            code, details = result["error"]
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
        assert pair.decoder.proc.wait(30) == 0
    finally:
        pair.stop()
