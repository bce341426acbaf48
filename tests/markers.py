"""The `slow` marker for whole modules: tests that start real services (encoder, decoder, gateway or
`mmserve up` as processes) or run the CLI in subprocesses. `python -m pytest -m "not slow"` leaves them
out (README: the quick subset); CI runs everything."""

from __future__ import annotations

import pytest

SLOW_MODULES = frozenset({
    "tests/bench/test_bench_cpu.py",
    "tests/bench/test_qwen_workload.py",
    "tests/bench/test_soak_smoke.py",
    "tests/common/test_devices.py",
    "tests/common/test_unsupported_checkpoint.py",
    "tests/encoder/test_cli.py",
    "tests/encoder/test_server.py",
    "tests/encoder/test_server_decode_pool.py",
    "tests/encoder/test_shm_sweeper.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_tensor_parallel_four.py",
    "tests/gateway/test_aiperf.py",
    "tests/gateway/test_cli_gateway.py",
    "tests/gateway/test_error_statuses.py",
    "tests/gateway/test_heavy_images.py",
    "tests/gateway/test_openai_pair.py",
    "tests/gateway/test_public_edge.py",
    "tests/gateway/test_strict_requests.py",
    "tests/gateway/test_video_url.py",
    "tests/gateway/test_vllm_extensions.py",
    "tests/k8s/test_pair_runs_locally.py",
    "tests/qwen/test_pair.py",
    "tests/qwen/test_up_openai.py",
    "tests/qwen3/test_encoder_service.py",
    "tests/security/test_secure_pair.py",
    "tests/security/test_up_tls.py",
    "tests/video/test_pair_video.py",
    "tests/video/test_up_openai_video.py",
})
SLOW_DIRS = ("tests/integration/",)


def mark_slow(items: list[pytest.Item], root: str) -> None:
    """Add the slow marker to every item of a slow module."""
    for item in items:
        path = str(item.path.relative_to(root)) if str(item.path).startswith(root) else str(item.path)
        if path in SLOW_MODULES or path.startswith(SLOW_DIRS):
            item.add_marker(pytest.mark.slow)
