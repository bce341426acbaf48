"""Videos served by the engine equal HF generate (fp32, greedy) on qwen2.5-vl-tiny and qwen3-vl-tiny:
Qwen2.5-VL's one run of video tokens with M-RoPE time steps of tokens_per_second x seconds per group,
Qwen3-VL's timestamped runs (one per group of frames) with DeepStack; a video and an image in one
request; chunk sizes that split the video; a repeated video is an encoder-cache hit and a prefix hit.

HF's video processor needs torchvision, so HF is given the patch rows common/video makes from the same
decoded frames (tests/video checks those against HF's own functions); the prompt expansion, positions
and the model are HF's."""

from __future__ import annotations

import io
import re

import av
import numpy as np
import pytest
import torch

from common.errors import InvalidInputError
from common.families.qwen2_5_vl.video_config import load_qwen_video_config
from common.families.qwen2_5_vl.video_timing import video_timing
from common.video import (
    VideoLimits,
    decode_video,
    video_patches,
    video_request_config,
)
from decoder_svc.engine import videos as videos_module
from decoder_svc.engine.embedding_source import VideoSource
from tests.oracle import greedy, run_all

N = 10
USER, END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
VIDEO_PROMPT = USER + "<|vision_start|><|video_pad|><|vision_end|>what happens here?" + END
MIXED_PROMPT = (USER + "<|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|video_pad|>"
                "<|vision_end|> compare them" + END)


def noise_video(num_frames: int = 24, fps: int = 8, width: int = 160, height: int = 120,
                seed: int = 0) -> bytes:
    """An mp4 (mpeg4) of random frames: every patch differs, so a wrong row order shows."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qscale": "2"}
        for _ in range(num_frames):
            rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


VIDEO = noise_video()


class VideoOracle:
    """HF generate on prompts with images and videos, inputs built as the HF processors build them: each
    `<|image_pad|>` and `<|video_pad|>` expanded in place (Qwen3-VL's video into timestamped groups, as
    its processor's replace_video_token does), then one tokenization."""

    def __init__(self, oracle, model_dir, fps: float = 0.0) -> None:
        from common.families.qwen2_5_vl.encoder_base import load_qwen_image_processor

        self.tokenizer, self.hf = oracle.tokenizer, oracle.model
        self.image_processor = load_qwen_image_processor(model_dir)
        self.config = video_request_config(load_qwen_video_config(model_dir), fps=fps, limits=VideoLimits())
        self.qwen3 = self.config.geometry.family == "qwen3_vl"

    def _video_text(self, grid, decoded) -> str:
        per_group = grid[1] * grid[2] // 4
        if not self.qwen3:
            return "<|video_pad|>" * (grid[0] * per_group)
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(decoded.indices), decoded.info.fps, 2)
        return "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_group + "<|vision_end|>"
                       for t in stamps)

    def generate(self, prompt: str, images, videos: list[bytes], n: int) -> list[int]:
        kwargs: dict = {}
        expansions = {"<|image_pad|>": [], "<|video_pad|>": []}
        if images:
            outs = [self.image_processor(images=[img], return_tensors="pt") for img in images]
            kwargs["pixel_values"] = torch.cat([o["pixel_values"] for o in outs])
            kwargs["image_grid_thw"] = torch.cat([o["image_grid_thw"] for o in outs])
            expansions["<|image_pad|>"] = ["<|image_pad|>" * (int(g.prod()) // 4)
                                           for g in kwargs["image_grid_thw"]]
        rows, grids, seconds = [], [], []
        for data in videos:
            decoded = decode_video(data, self.config.sampling.indices_for, VideoLimits())
            r, grid = video_patches(decoded.frames, self.config)
            info = decoded.info
            timing = video_timing(decoded.indices, info.total_frames, info.fps, 2)
            rows.append(r)
            grids.append(list(grid))
            seconds.append(timing.second_per_grid)
            expansions["<|video_pad|>"].append(self._video_text(grid, decoded))
        pieces = re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", prompt)
        queues = {k: iter(v) for k, v in expansions.items()}
        text = "".join(next(queues[p]) if p in queues else p for p in pieces)
        enc = self.tokenizer(text, return_tensors="pt")
        ids, cfg = enc["input_ids"], self.hf.config
        video_tokens = (ids == cfg.video_token_id).int()
        kwargs["mm_token_type_ids"] = (ids == cfg.image_token_id).int() + 2 * video_tokens
        if videos:
            kwargs["pixel_values_videos"] = torch.cat(rows)
            kwargs["video_grid_thw"] = torch.tensor(grids)
            if not self.qwen3:
                kwargs["second_per_grid_ts"] = torch.tensor(seconds)
        with torch.no_grad():
            out = self.hf.generate(input_ids=ids, attention_mask=enc["attention_mask"], do_sample=False,
                                   max_new_tokens=n, **kwargs)
        return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=["qwen2.5-vl-tiny", "qwen3-vl-tiny"])
def family(request):
    """(engine factory, video oracle) of one preset."""
    name = "qwen" if request.param == "qwen2.5-vl-tiny" else "qwen3"
    model_dir = request.getfixturevalue(f"{name}_model_dir")
    oracle = request.getfixturevalue(f"{name}_oracle")
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource

    def make(**overrides):
        cfg = EngineConfig(**{"model": model_dir, "num_kv_blocks": 512, **overrides})
        return LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))

    return make, VideoOracle(oracle, model_dir)


@pytest.mark.parametrize("budget", [13, 2048])
def test_one_video_equals_hf(family, budget):
    make, oracle = family
    engine = make(max_num_batched_tokens=budget)
    out = engine.generate("v", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    assert out.error is None, out.error
    ref = oracle.generate(VIDEO_PROMPT, [], [VIDEO], N)
    assert out.new_token_ids == ref
    assert len(set(ref)) > 3
    assert engine.stats().kv_blocks_used == 0 and engine.source.num_leases == 0


def test_video_and_image_in_one_request(family, qwen_images):
    make, oracle = family
    engine = make(max_num_batched_tokens=64)
    out = engine.generate("m", MIXED_PROMPT, qwen_images[:1], videos=[VideoSource(VIDEO)], sampling=greedy(N))
    assert out.error is None, out.error
    assert out.new_token_ids == oracle.generate(MIXED_PROMPT, qwen_images[:1], [VIDEO], N)
    assert out.usage.images == 1


def test_repeated_video_is_a_cache_and_prefix_hit(family, monkeypatch):
    make, oracle = family
    engine = make(max_num_batched_tokens=64)
    planned = []
    real_plan = videos_module.plan_video
    monkeypatch.setattr(videos_module, "plan_video",
                        lambda *a, **k: planned.append(a[3]) or real_plan(*a, **k))  # a[3]: the salt
    cold = engine.generate("a", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    engine_source = engine.source
    encoded = engine_source.num_encoded
    warm = engine.generate("b", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    assert warm.new_token_ids == cold.new_token_ids == oracle.generate(VIDEO_PROMPT, [], [VIDEO], N)
    assert warm.usage.cached_prompt_tokens == (warm.usage.prompt_tokens - 1) // 16 * 16
    assert engine_source.num_encoded == encoded  # not encoded again
    assert planned == [""]  # the repeat's container was not read again: its plan is remembered
    engine.generate("s", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(2), cache_salt="t2")
    assert planned == ["", "t2"]  # under another salt it is another video
    # Prefix caching off: the same video is fetched again, from the source's cache.
    engine = make(max_num_batched_tokens=64, enable_prefix_caching=False)
    engine.generate("c", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    engine.generate("d", VIDEO_PROMPT, videos=[VideoSource(VIDEO)], sampling=greedy(N))
    assert engine.source.num_encoded == 1 and engine.source.num_cache_hits >= 1


def test_bad_videos_are_refused_before_decoding(family):
    make, _ = family
    engine = make()
    for videos, prompt, match in [
        ([VideoSource(b"not a video at all")], VIDEO_PROMPT, "video 0"),
        ([VideoSource(None)], VIDEO_PROMPT, "video 0: send the video's bytes"),
        ([VideoSource(VIDEO)], USER + "no marker" + END, "placeholders but 1 videos"),
        ([VideoSource(VIDEO, max_frames=100_000)], VIDEO_PROMPT, "video 0: max_frames"),
    ]:
        with pytest.raises(InvalidInputError, match=match):
            engine.add_request("bad", prompt, videos=videos, sampling=greedy(N))
    assert not engine.has_unfinished() and engine.source.num_leases == 0


def test_llava_refuses_videos(tiny_model_dir):
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource

    cfg = EngineConfig(model=tiny_model_dir, num_kv_blocks=64)
    engine = LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))
    with pytest.raises(InvalidInputError, match="does not take video"):
        engine.add_request("v", "USER: hi ASSISTANT:", videos=[VideoSource(VIDEO)], sampling=greedy(4))


def test_run_all_leaves_nothing(family):
    make, _ = family
    engine = make(max_num_batched_tokens=32, max_num_seqs=4)
    for i in range(4):
        engine.add_request(f"r{i}", VIDEO_PROMPT, videos=[VideoSource(noise_video(seed=i % 2))],
                           sampling=greedy(6))
    results = run_all(engine)
    assert all(r["error"] is None for r in results.values())
    assert engine.stats().kv_blocks_used == 0 and engine.scheduler.images.num_held == 0


def test_lookahead_prefetches_queued_videos(family):
    """Queued requests' videos are asked for ahead of their prefill (prefetch=True, with their bytes and
    resolved settings), as images are; the tokens still equal HF's."""
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource
    from tests.fakes import GatedSource

    make, oracle = family
    model = make().config.model
    cfg = EngineConfig(model=model, num_kv_blocks=512, max_num_seqs=1, encoder_max_ahead=2)
    source = GatedSource(LocalEmbeddingSource.for_engine(cfg))
    engine = LLMEngine(cfg, source)
    clips = [noise_video(seed=10 + i) for i in range(3)]
    for i, clip in enumerate(clips):
        engine.add_request(f"r{i}", VIDEO_PROMPT, videos=[VideoSource(clip)], sampling=greedy(N))
    engine.step()  # r0 runs; r1 and r2 are next in the queue
    asks = [a for a in source.asks if a.prefetch]
    assert {a.request_id for a in asks} == {"r1", "r2"}
    assert all(a.video is not None and a.video.data is not None and a.video.fps > 0 for a in asks)
    results = run_all(engine)
    assert results["r2"]["tokens"] == oracle.generate(VIDEO_PROMPT, [], [clips[2]], N)
    assert source.inner.num_leases == 0
