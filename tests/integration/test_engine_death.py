"""When the engine itself cannot go on, the decoder says so and exits non-zero, so a restart policy
brings it back: open streams get an error, health turns NOT_SERVING, the process exits with code 1.

The fault is planted from outside the code under test: a sitecustomize module on the decoder's
PYTHONPATH wraps LLMEngine.step to raise (as a device error would) once a request whose client id
contains "explode" is running.
"""

from __future__ import annotations

import textwrap

import grpc
import pytest

from tests.integration.harness import ROOT, Pair

PLANT = textwrap.dedent('''
    import decoder_svc.engine.engine as engine_module

    _step = engine_module.LLMEngine.step

    def step(self):
        if any("explode" in r.request_id for r in self.scheduler.running):
            raise SystemError("planted device failure")
        return _step(self)

    engine_module.LLMEngine.step = step
''')


def test_a_dead_engine_fails_open_streams_and_exits_non_zero(tiny_model_dir, tmp_path, monkeypatch):
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT)
    monkeypatch.setenv("PYTHONPATH", f"{plant}:{ROOT}")  # the plant imports this checkout's engine
    pair = Pair(tiny_model_dir, tmp_path).start()
    try:
        with pair.decoder_client(timeout=60) as client:
            assert client.generate_text("USER: hi ASSISTANT:", max_tokens=2).finish_reason == "LENGTH"
            with pytest.raises(grpc.RpcError) as err:
                client.generate_text("USER: hi ASSISTANT:", max_tokens=2, request_id="explode")
            assert err.value.code() == grpc.StatusCode.INTERNAL and "engine failed" in err.value.details()
        assert pair.decoder.proc.wait(30) == 1
    finally:
        pair.stop()
