"""bench.video_serve's pieces without services: the clips it makes (distinct, sampled as the model's
video config says) and its headline when parts are missing."""

from __future__ import annotations

import argparse

from bench import video_serve
from common.video import probe_video


def test_clips_are_distinct_and_sampled_at_two_fps(qwen_model_dir):
    codec = video_serve.pick_codec()
    assert codec in ("libx264", "mpeg4")
    a, b = (video_serve.make_clip(3, 10, 56, seed=s, codec=codec) for s in (1, 2))
    assert a != b
    info = probe_video(a)
    assert (info.width, info.height, info.total_frames) == (56, 56, 30)
    desc = video_serve.describe_clip(a, video_serve.video_config(str(qwen_model_dir)))
    assert desc["sampled_frames"] == 6 and desc["grid_thw"] == [3, 4, 4] and desc["tokens"] == 12
    assert video_serve.make_clip(1, 4, 56, seed=0, codec="mpeg4")[4:8] == b"ftyp"


def test_headline_rows_without_results(tmp_path):
    args = video_serve.build_arg_parser().parse_args(["--model", "x", "--device", "cpu",
                                                      "--out", str(tmp_path / "v.json")])
    result = {"ttft": {"error": "RuntimeError: boom"}}
    video_serve._finish(argparse.Namespace(**vars(args)), "qwen", result)
    assert len(result["headline"]) == 5 and all(v is None for _, v in result["headline"])
    assert (tmp_path / "v.json").is_file()
