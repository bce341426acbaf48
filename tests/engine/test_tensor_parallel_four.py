"""Four tensor-parallel ranks on CPU (gloo) over the tiny LLaVA preset's 2 KV heads: each KV head is
replicated on two ranks (tests/engine/test_kv_head_split.py has the rule), and the served tokens equal
HF's. At TP=2 (tests/engine/test_tensor_parallel.py) every rank holds its own KV head, so a wrong
first KV head of a replicated rank shows only here."""

from __future__ import annotations

from common.families.llava.oracle import LlavaOracle
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.oracle import greedy, make_image, run_all

N = 8
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TEXT = "USER: tell me a story about a red car ASSISTANT:"


def test_four_ranks_over_two_kv_heads_equal_hf(tiny_model_dir):
    oracle = LlavaOracle(tiny_model_dir)
    text_config = oracle.model.config.text_config
    assert (text_config.num_attention_heads, text_config.num_key_value_heads) == (4, 2)  # replicated at TP=4
    image = make_image(3, (48, 40))
    # Chunks of 13 tokens: the image's span is split, and the two requests share steps.
    config = EngineConfig(model=tiny_model_dir, num_kv_blocks=64, tensor_parallel_size=4,
                          max_num_batched_tokens=13)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    try:
        assert engine.model_config.num_kv_heads == 1 and engine.model_config.num_heads == 1
        engine.add_request("image", ONE, [image], sampling=greedy(N))
        engine.add_request("text", TEXT, sampling=greedy(N))
        results = run_all(engine)
        assert engine.stats().kv_blocks_used == 0
    finally:
        engine.close()
    oracle.assert_same_tokens(results["image"]["tokens"], ONE, [image], N)
    oracle.assert_same_tokens(results["text"]["tokens"], TEXT, [], N)
