"""The lease race, forced: an encoder cache that holds one embedding (each new image evicts the last and
is written into the same slice) and a decoder whose GPU work runs late on purpose. Every served token
must still equal HF's.

The decoder's GPU work is delayed from outside the code under test: a sitecustomize module on its
PYTHONPATH queues a ~20 ms GPU sleep either before each model step (the step's reads of image rows run
long after the host has moved on) or before each embedding copy on the remote source's side stream (the
copy out of the encoder's slice runs late). If the decoder read the encoder's slice after giving its
lease back, or read its own copy before the copy finished, the wrong rows would show up as wrong tokens.
"""

from __future__ import annotations

import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.families.llava.encoder import LlavaVisionEncoder as VisionEncoder
from common.families.llava.oracle import LlavaOracle
from tests.integration.conftest import png
from tests.integration.harness import ROOT, Pair
from tests.oracle import make_image

pytestmark = pytest.mark.gpu

PROMPT = "USER: <image>\nWhat is in this picture? ASSISTANT:"
MAX_TOKENS = 12

LATE_STEPS = textwrap.dedent('''
    import torch
    import decoder_svc.runner.model_runner as runner_module

    _launch = runner_module.ModelRunner.launch

    def launch(self, batch):
        torch.cuda._sleep(40_000_000)  # GPU cycles (~20 ms): the step's reads run late
        return _launch(self, batch)

    runner_module.ModelRunner.launch = launch  # execute() calls it too
''')

# The embedding copy itself runs late: a GPU sleep queued on the copier's side stream before each copy.
# Were the fetch thread not to wait for its copy before marking the image READY (or before giving the
# encoder's lease back), the model would read unfinished rows, or rows of the next image written into
# the one slot: wrong tokens.
LATE_COPIES = textwrap.dedent('''
    import torch
    import decoder_svc.encoders.side_stream as source_module

    _copy = source_module.SideStreamCopier.copy

    def copy(self, ref, encoder):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(40_000_000)  # ~20 ms before the copy starts on the side stream
        return _copy(self, ref, encoder)

    source_module.SideStreamCopier.copy = copy
''')


@pytest.mark.parametrize("plant_code", [LATE_STEPS, LATE_COPIES], ids=["late-steps", "late-copies"])
def test_one_slot_encoder_and_late_gpu_work_still_serve_each_request_its_own_image(
        plant_code, tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("cupy")
    one_embedding = VisionEncoder(tiny_model_dir, torch.device("cpu"), torch.float32).embedding_nbytes
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(plant_code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(plant), str(ROOT),
                                                                 os.environ.get("PYTHONPATH", "")) if p))
    images = [make_image(100 + i) for i in range(6)]
    jobs = [images[i % 6] for i in range(12)]  # every image twice: evicted in between, encoded again
    oracle = LlavaOracle(tiny_model_dir, device="cuda", dtype=torch.float32)
    for img in images:
        oracle.generate(PROMPT, [img], MAX_TOKENS)  # before the pair starts: HF's time is not in the race
    pair = Pair(tiny_model_dir, tmp_path,
                encoder_args=["--device", "cuda", "--cache-bytes", str(one_embedding)],
                decoder_args=["--device", "cuda", "--max-num-batched-tokens", "64"]).start()
    try:
        def serve(img):
            with pair.decoder_client() as client:
                return client.generate_text(PROMPT, [png(img)], max_tokens=MAX_TOKENS).token_ids

        with ThreadPoolExecutor(len(jobs)) as pool:
            served = list(pool.map(serve, jobs))
        for img, tokens in zip(jobs, served, strict=True):
            oracle.assert_same_tokens(list(tokens), PROMPT, [img], MAX_TOKENS)
        with pair.encoder_client() as enc:
            stats = enc.stats()
        # The one slice really was rewritten under the decoder: each distinct image after the first.
        assert stats.evictions >= len(images) - 1
        d, e = pair.wait_idle()
        assert d.kv_blocks_used == 0 and d.active_leases == 0 and e.active_leases == 0
    finally:
        pair.stop()
