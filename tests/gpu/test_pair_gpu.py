"""The encoder and decoder on one GPU: CUDA IPC handoff, and HF parity in fp32."""

from __future__ import annotations

import pytest
import torch

from common.families.llava.oracle import LlavaOracle
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import make_image

pytestmark = pytest.mark.gpu

PROMPT_1 = "USER: <image>\nWhat is in this picture? ASSISTANT:"
PROMPT_2 = "USER: <image>\nCompare with <image>\nWhich is brighter? ASSISTANT:"


def test_pair_on_one_gpu_uses_cuda_ipc_and_matches_hf(tiny_model_dir, tmp_path):
    cupy = pytest.importorskip("cupy")
    assert cupy.cuda.runtime.getDeviceCount() > 0
    oracle = LlavaOracle(tiny_model_dir, device="cuda", dtype=torch.float32)
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=["--device", "cuda"],
                decoder_args=["--device", "cuda", "--max-num-batched-tokens", "64"]).start()
    try:
        images = [make_image(s) for s in (21, 22, 23)]
        with pair.decoder_client() as client:
            for prompt, imgs in ((PROMPT_1, images[:1]), (PROMPT_2, images[1:3]), (PROMPT_1, images[:1])):
                result = client.generate_text(prompt, [png(i) for i in imgs], max_tokens=16)
                oracle.assert_same_tokens(result.token_ids, prompt, imgs, 16)
            stats = client.stats()
        transports = dict(stats.embedding_transports)
        print(f"\ndecoder embedding transports: {transports}")
        assert transports.get("cuda_ipc", 0) >= 3 and set(transports) == {"cuda_ipc"}
        d, e = pair.wait_idle()
        assert d.kv_blocks_used == 0 and d.active_leases == 0 and e.active_leases == 0
        # the encoder's own device memory beside its arena: the tower's weights at least
        assert e.device_memory_reserved_bytes >= e.device_memory_allocated_bytes > 0
    finally:
        pair.stop()
