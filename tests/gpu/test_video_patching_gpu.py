"""A video patched on the GPU (the encoder's device-side processor in bf16): the rows of its uint8 frames
equal the host's exactly on the 28-px grid and within a pixel level when resized, and the bf16 tower's
embedding of them is close to the fp32 host path's."""

from __future__ import annotations

import torch

from common.families.qwen2_5_vl.encoder import QwenVisionEncoder
from tests.video.test_device_patching import CLIPS, _job


def test_frames_patched_on_the_gpu(qwen_model_dir):
    host = QwenVisionEncoder(qwen_model_dir, preprocess="hf")
    dev = QwenVisionEncoder(qwen_model_dir, "cuda", torch.bfloat16)
    assert dev.patches_videos_on_device
    for name, data in CLIPS.items():
        job = _job(qwen_model_dir, data)
        rows, frames = job.decode(), job.decode(patch=False)
        diff = (dev._rows(frames).cpu() - rows.pixel_values).abs().max().item()
        if name == "on_grid":
            assert diff == 0.0
        else:  # float bicubic on the GPU against the CPU's uint8 kernel: a level at most
            assert diff <= dev.pixel_tolerance
        (want,), (got,) = host.encode_prepared([rows]), dev.encode_prepared([frames])
        rel = (got.float().cpu() - want).norm() / want.norm()
        assert rel < 0.05, f"{name}: bf16 tower relative error {rel:.4f}"
