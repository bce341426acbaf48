"""The pan-and-scan switch and the per-group KV stats through the running encoder and decoder services
(gemma-3-tiny with crops off in its config, crop rule from 32 px: conftest.py's gemma3_pas_off_dir).

ImageInput.pan_and_scan in a prompt request and in a chat image part gives HF's tokens with crops (the
oracle passes the settings explicitly); unset gives HF's without; the encoder's entries differ in rows and
hash. DecoderStats.kv_groups lists the full layers' group and the sliding one with its window, and after
the requests every group's blocks_used is 0 (the leak check, through the Stats RPC)."""

from __future__ import annotations

import pytest

from common.families.oracle import greedy_new_tokens
from common.images import encode_png
from common.pb import common_pb2
from tests.gemma3.conftest import sample_images
from tests.gemma3.test_pan_and_scan import CASES
from tests.integration.harness import Pair

N = 8
WINDOW = 16  # gemma-3-tiny's sliding_window


@pytest.fixture(scope="module")
def pair(gemma3_pas_off_dir, tmp_path_factory):
    pair = Pair(gemma3_pas_off_dir, tmp_path_factory.mktemp("gemma3-pas-pair"),
                decoder_args=["--num-kv-blocks", "256", "--max-num-batched-tokens", "20",
                              "--encoder-timeout", "30"]).start()
    yield pair
    pair.stop()


def _inputs(images, pan_and_scan: bool | None) -> list[common_pb2.ImageInput]:
    out = []
    for image in images:
        item = common_pb2.ImageInput(data=encode_png(image))
        if pan_and_scan is not None:
            item.pan_and_scan = pan_and_scan
        out.append(item)
    return out


def _groups(stats) -> list[tuple[str, int]]:
    return [(g.name, g.window) for g in stats.kv_groups]


def test_stats_list_the_kv_groups(pair) -> None:
    with pair.decoder_client() as client:
        stats = client.stats()
    assert _groups(stats) == [("full", 0), (f"sliding_{WINDOW}", WINDOW)]
    assert all(g.blocks_total > 0 for g in stats.kv_groups)
    assert sum(g.blocks_total for g in stats.kv_groups) == stats.kv_blocks_total
    assert stats.kv_groups[1].blocks_total <= stats.kv_groups[0].blocks_total  # never more (kv_groups.py)


@pytest.mark.parametrize("case", ["wide", "two"])
def test_prompt_requests_with_and_without_the_switch(pair, gemma3_pas_oracle, gemma3_oracle, case) -> None:
    prompt, idx = CASES[case]
    images = [sample_images()[i] for i in idx]
    with pair.decoder_client(timeout=300) as client:
        on = client.generate_text(prompt, _inputs(images, True), max_tokens=N)
        plain = client.generate_text(prompt, _inputs(images, None), max_tokens=N)
        off = client.generate_text(prompt, _inputs(images, False), max_tokens=N)
    assert on.token_ids == gemma3_pas_oracle.generate(prompt, images, N)
    assert plain.token_ids == off.token_ids == gemma3_oracle.generate(prompt, images, N)
    assert on.usage.prompt_tokens > plain.usage.prompt_tokens  # the crops' blocks and sentence
    stats, _ = pair.wait_idle()
    assert [g.blocks_used for g in stats.kv_groups] == [0, 0]


def test_a_chat_image_part_takes_the_switch(pair, gemma3_pas_oracle) -> None:
    image = sample_images()[3]  # the strip: four crops
    (item,) = _inputs([image], True)
    chat = [{"role": "user", "content": [{"type": "image", "image": item},
                                         {"type": "text", "text": "what is this?"}]}]
    with pair.decoder_client(timeout=300) as client:
        out = client.generate_text(chat=chat, max_tokens=N)
    hf_messages = [{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": "what is this?"}]}]
    want = greedy_new_tokens(gemma3_pas_oracle.model, gemma3_pas_oracle.chat_inputs(hf_messages, [image]), N)
    assert out.token_ids == want
    stats, _ = pair.wait_idle()
    assert stats.kv_blocks_used == 0 and [g.blocks_used for g in stats.kv_groups] == [0, 0]


def test_the_encoder_makes_two_entries(pair) -> None:
    """The encoder's own answer to the switch: 3 blocks of rows (2 crops) or 1, under two hashes."""
    image = sample_images()[0]
    with pair.encoder_client() as client:
        on, off, plain = client.encode([*_inputs([image], True), *_inputs([image], False),
                                        *_inputs([image], None)]).embeddings
    assert on.shape[0] == 3 * 16 and off.shape[0] == plain.shape[0] == 16
    assert on.content_hash != off.content_hash == plain.content_hash
    assert list(on.grid_thw) == [3, 1, 1]
