"""`python -m encoder_svc` as a real process: SERVING after warm-up, metrics, clean SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
import torch

from common.health import wait_until_serving
from common.pb import encoder_pb2, encoder_pb2_grpc
from common.startup import free_port
from common.transport import import_embedding
from common.transport.shm import SHM_DIR
from encoder_svc.main import build_arg_parser
from tests.cli_errors import assert_usage_error, busy_port, decoy_model, run_cli
from tests.encoder.conftest import encode_request, image_bytes


def test_arg_parser_defaults(tmp_path):
    args = build_arg_parser().parse_args(["--model", str(decoy_model(tmp_path / "m"))])
    assert (args.host, args.port, args.device, args.dtype) == ("127.0.0.1", 50051, "auto", "auto")
    assert args.metrics_port is None and args.cache_bytes > 0 and args.lease_ttl > 0
    assert (args.max_batch_images, args.preprocess, args.preprocess_threads) == (32, "auto", None)


def test_max_batch_size_is_the_old_name_of_max_batch_images(tmp_path):
    def parsed(*argv: str):
        return build_arg_parser().parse_args(["--model", str(decoy_model(tmp_path / "m")), *argv])

    assert parsed("--max-batch-size", "5").max_batch_images == 5
    assert parsed("--max-batch-images", "64").max_batch_images == 64


def test_module_entry_point_serves_and_stops_cleanly(tiny_model_dir):
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "encoder_svc", "--model", str(tiny_model_dir), "--port", str(port),
         "--metrics-port", str(metrics_port), "--cache-bytes", str(1 << 20), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until_serving(f"127.0.0.1:{port}", timeout=90, is_alive=lambda: proc.poll() is None), \
            proc.stdout.read() if proc.poll() is not None else "not SERVING in time"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            resp = stub.Encode(encode_request(image_bytes(7)), timeout=30)
            ref = resp.embeddings[0]
            emb = import_embedding(ref)
            assert emb.shape == (16, 64) and torch.isfinite(emb).all()
            stub.Release(encoder_pb2.ReleaseRequest(lease_ids=[ref.lease_id]), timeout=10)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        assert b"mmserve_encoder_cache_misses_total 1.0" in metrics
        segment = SHM_DIR / ref.shm.name
        assert segment.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not segment.exists(), "the encoder must unlink its shared memory on shutdown"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# User errors: exit code 2 and one `mmserve encoder: error: ...` line, no traceback. The decoy model
# cannot load, so the cases that use it prove the error comes before any loading.

def test_missing_model_dir_is_a_usage_error(tmp_path):
    last = assert_usage_error(run_cli("encoder", "--model", str(tmp_path / "missing"), "--port", "0",
                                      timeout=30), "--model", "not a directory")
    assert last.startswith("mmserve encoder: error:")
    assert_usage_error(run_cli("encoder", "--model", str(tmp_path), timeout=30), "no config.json")


@pytest.mark.parametrize("option, value, needle", [
    ("--dtype", "float64x", "unknown dtype 'float64x'"),
    ("--cache-bytes", "0", "--cache-bytes: must be at least 1"),
    ("--max-batch-size", "-1", "--max-batch-size"),
    ("--max-batch-images", "0", "--max-batch-images"),
    ("--preprocess", "gpu", "invalid choice: 'gpu'"),
    ("--preprocess-threads", "0", "--preprocess-threads"),
    ("--port", "70000", "--port: must be from 0 to 65535"),
    ("--lease-ttl", "nan", "--lease-ttl: must be a positive number"),
])
def test_bad_option_values_are_usage_errors(tmp_path, option, value, needle):
    result = run_cli("encoder", "--model", str(decoy_model(tmp_path / "m")), "--port", "0", option, value,
                     timeout=30)
    assert_usage_error(result, needle)


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_busy_port_is_a_usage_error_before_loading(tmp_path, option):
    with busy_port() as port:
        args = ["--port", "0", option, str(port)] if option == "--metrics-port" else ["--port", str(port)]
        result = run_cli("encoder", "--model", str(decoy_model(tmp_path / "m")), *args, timeout=30)
    assert_usage_error(result, f"{option} {port}", "already in use")


def test_cache_too_small_for_one_embedding_is_a_usage_error(tiny_model_dir):
    result = run_cli("encoder", "--model", str(tiny_model_dir), "--port", "0", "--cache-bytes", "10",
                     "--log-level", "WARNING", timeout=120)
    assert_usage_error(result, "--cache-bytes 10 cannot hold one image's embedding")


@pytest.mark.parametrize("service", ["encoder", "decoder"])
def test_an_unknown_event_loop_is_a_usage_error(tmp_path, monkeypatch, service):
    monkeypatch.setenv("MMSERVE_EVENT_LOOP", "trio")
    extra = ["--encoder", "127.0.0.1:1"] if service == "decoder" else []
    result = run_cli(service, "--model", str(decoy_model(tmp_path / "m")), "--port", "0", *extra, timeout=30)
    assert_usage_error(result, "MMSERVE_EVENT_LOOP='trio'", "expected one of auto, asyncio, uvloop")
