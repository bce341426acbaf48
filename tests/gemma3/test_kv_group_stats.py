"""DecoderStats.kv_groups from the engine's KV cache manager, as the Stats RPC builds it (to_message of the
service's record): Gemma 3's full and sliding groups with their windows, blocks held while requests run
and none after; a model without sliding layers (LLaVA) lists one group, equal to the totals."""

from __future__ import annotations

from common.pb import decoder_pb2
from common.stats import to_message
from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from decoder_svc.stats import DecoderStats
from tests.gemma3.conftest import sample_images
from tests.gemma3.test_image_generate import make_engine
from tests.oracle import greedy


def _message(engine) -> decoder_pb2.DecoderStats:
    return to_message(DecoderStats(engine.stats()), decoder_pb2.DecoderStats)


def test_gemma_lists_its_full_and_sliding_groups(gemma3_tiny_dir) -> None:
    engine = make_engine(gemma3_tiny_dir, block_size=4, num_kv_blocks=256, max_num_batched_tokens=24)
    groups = _message(engine).kv_groups
    assert [(g.name, g.window) for g in groups] == [("full", 0), ("sliding_16", 16)]
    prompt = ("<start_of_turn>user\n" + "tell me more " * 12
              + "<start_of_image><end_of_turn>\n<start_of_turn>model\n")
    engine.add_request("r", prompt, [sample_images()[0]], sampling=greedy(24))
    seen = []  # (full, sliding) blocks held after each step
    while engine.has_unfinished():
        engine.step()
        message = _message(engine)
        seen.append(tuple(g.blocks_used for g in message.kv_groups))
        assert sum(seen[-1]) == message.kv_blocks_used
    full, sliding = zip(*seen[:-1], strict=True)
    assert max(full) > 10  # the whole sequence, 4 tokens a block
    # the window's blocks only: 16 tokens (4 blocks), plus the partial ones and a chunk's worth
    assert 0 < max(sliding) <= (16 + 24) // 4 + 2 < max(full)
    after = _message(engine)
    assert [g.blocks_used for g in after.kv_groups] == [0, 0] and after.kv_blocks_used == 0
    assert sum(g.blocks_total for g in after.kv_groups) == after.kv_blocks_total
    assert sum(g.blocks_cached_free for g in after.kv_groups) == after.kv_blocks_cached_free > 0


def test_a_model_without_sliding_layers_lists_one_group(tiny_model_dir) -> None:
    config = EngineConfig(model=tiny_model_dir, num_kv_blocks=64)
    engine = LLMEngine(config, LocalEmbeddingSource.for_engine(config))
    engine.generate("r", "hello there", sampling=greedy(4))
    message = _message(engine)
    (group,) = message.kv_groups
    assert (group.name, group.window, group.blocks_used) == ("full", 0, 0)
    assert group.blocks_total == message.kv_blocks_total == 64
    assert group.blocks_cached_free == message.kv_blocks_cached_free
