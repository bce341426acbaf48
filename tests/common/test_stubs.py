"""The committed stubs are what grpcio-tools 1.84.0 generates from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_protos():
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_and_carry_the_contract():
    from common.pb import common_pb2, decoder_pb2, decoder_pb2_grpc, encoder_pb2, encoder_pb2_grpc

    assert {m.name for m in encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].methods} == {
        "Encode", "Prefetch", "Release", "Lookup", "GetStats"}
    assert {m.name for m in decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].methods} == {
        "Generate", "GetStats"}
    ref = common_pb2.EmbeddingRef(shm=common_pb2.ShmLocation(name="x"))
    assert ref.WhichOneof("location") == "shm"
    assert decoder_pb2.SamplingParams().HasField("seed") is False
    assert encoder_pb2_grpc.EncoderServiceStub and decoder_pb2_grpc.DecoderServiceStub
