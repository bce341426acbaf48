"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens (and HF's) on the tiny presets of
each family (LLaVA; Qwen2.5-VL with one KV head per rank; Qwen3-VL with DeepStack), through chunked
prefill, prefix reuse and preemption; shapes that cannot be split are refused; and a killed rank makes
the decoder service exit non-zero instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from common.checkpoint import CheckpointError
from common.families.llava.oracle import LlavaOracle
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.engine.warm_up import warm_up
from decoder_svc.runner.tensor_parallel import RANK_DIED_EXIT_CODE
from tests.integration.conftest import png
from tests.integration.harness import Pair
from tests.oracle import greedy, make_image, run_all

N = 10
QWEN_USER, QWEN_END = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
QWEN_ONE = QWEN_USER + "<|vision_start|><|image_pad|><|vision_end|>what is in the picture?" + QWEN_END
LLAVA_ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"


def _engine(model_dir: Path, tp: int, **overrides) -> LLMEngine:
    cfg = EngineConfig(**{"model": model_dir, "num_kv_blocks": 256, "tensor_parallel_size": tp, **overrides})
    return LLMEngine(cfg, LocalEmbeddingSource.for_engine(cfg))


def _serve(model_dir: Path, tp: int, plan: dict, full_warm_up: bool = False, **overrides
           ) -> tuple[dict, LLMEngine]:
    engine = _engine(model_dir, tp, **overrides)
    try:
        if full_warm_up:  # the service's start on a GPU (engine/warm_up.py)
            warm_up(engine, full=True)
        for rid, (prompt, images) in plan.items():
            engine.add_request(rid, prompt, images, sampling=greedy(N))
        results = run_all(engine)
        assert all(r["error"] is None for r in results.values())
        return {rid: r["tokens"] for rid, r in results.items()}, engine
    finally:
        engine.close()


@pytest.fixture(params=["llava", "qwen2.5", "qwen3"])
def preset(request):
    """(checkpoint, prompt with one image, text prompt) of each family's tiny preset."""
    if request.param == "llava":
        return request.getfixturevalue("tiny_model_dir"), LLAVA_ONE, "USER: tell me a story ASSISTANT:"
    name = "qwen_model_dir" if request.param == "qwen2.5" else "qwen3_model_dir"
    return request.getfixturevalue(name), QWEN_ONE, QWEN_USER + "tell me a story" + QWEN_END


def test_two_ranks_give_one_ranks_tokens(preset):
    """Chunks of 13 tokens (image spans split), prefix reuse (the same image twice) and a KV pool small
    enough to preempt: TP=2 serves exactly what TP=1 serves."""
    model_dir, one, text = preset
    images = [make_image(1, (64, 48)), make_image(2, (40, 52))]
    plan = {"text": (text, []), "a": (one, images[:1]), "b": (one, images[1:]), "a-again": (one, images[:1])}
    config = dict(max_num_batched_tokens=13, num_kv_blocks=24, max_num_seqs=4)
    single, _ = _serve(model_dir, 1, plan, **config)
    split, engine = _serve(model_dir, 2, plan, **config)
    assert split == single
    assert engine.stats().preemptions > 0 or engine.stats().prefix_cache_hit_tokens > 0
    assert engine.stats().kv_blocks_used == 0


def test_two_ranks_equal_hf_after_the_full_warm_up(tiny_model_dir):
    oracle = LlavaOracle(tiny_model_dir)
    image = make_image(5)
    tokens, engine = _serve(tiny_model_dir, 2, {"r": (LLAVA_ONE, [image])}, full_warm_up=True)
    heads = oracle.model.config.text_config.num_attention_heads
    assert engine.model.tp is not None and engine.model_config.num_heads * 2 == heads  # a real split
    oracle.assert_same_tokens(tokens["r"], LLAVA_ONE, [image], N)


def test_shapes_that_cannot_be_split_are_refused(tiny_model_dir):
    with pytest.raises(CheckpointError, match="cannot be split over 3"):
        _engine(tiny_model_dir, 3)


@pytest.mark.parametrize("arena", ["shm", "private"])
def test_two_ranks_behind_the_services_equal_hf(arena, tiny_model_dir, tmp_path):
    """The TP=2 decoder service with embeddings from a real encoder (shared memory, or inline bytes from a
    private arena): the rows reach rank 1 packed (runner/step_rows.py), the answers equal HF's and every
    block and lease is given back."""
    oracle = LlavaOracle(tiny_model_dir)
    images = [make_image(7, (64, 48)), make_image(8)]
    args = ["--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--max-num-batched-tokens", "13"]
    pair = Pair(tiny_model_dir, tmp_path, encoder_args=["--arena", arena], decoder_args=args).start()
    try:
        with pair.decoder_client() as client:
            results = [client.generate_text(LLAVA_ONE, [png(image)], max_tokens=N) for image in images]
            stats = client.stats()
        with pair.encoder_client() as client:
            leases = client.stats().active_leases
    finally:
        pair.stop()
    for image, result in zip(images, results, strict=True):
        oracle.assert_same_tokens(result.token_ids, LLAVA_ONE, [image], N)
    assert (stats.kv_blocks_used, stats.running, leases) == (0, 0, 0)


def test_a_killed_rank_stops_the_service(tiny_model_dir, tmp_path):
    """The decoder's worker rank is killed: the service exits (code from the engine core's death) and a
    request in flight fails instead of hanging."""
    args = ["--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--encoder-timeout", "10"]
    pair = Pair(tiny_model_dir, tmp_path, decoder_args=args).start()
    try:
        workers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_worker(p)]
        assert len(workers) == 1
        os.kill(int(workers[0].name), signal.SIGKILL)
        with pytest.raises(grpc.RpcError):
            with pair.decoder_client(timeout=60) as client:
                client.generate_text("USER: hello ASSISTANT:", max_tokens=200, ignore_eos=True)
        proc = pair.decoder.proc
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() not in (None, 0), "the decoder went on without its rank"
        assert f"exited with code {RANK_DIED_EXIT_CODE}" in pair.decoder.log_tail(200) or \
            "tensor-parallel rank 1 exited" in pair.decoder.log_tail(200)
    finally:
        pair.stop()


def _is_worker(proc_dir: Path) -> bool:
    try:
        return b"decoder_svc.runner.tp_worker" in (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False
