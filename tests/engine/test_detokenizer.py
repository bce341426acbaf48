"""Incremental detokenization never sends text it must take back, and never splits a character."""

from __future__ import annotations

import random

import pytest

from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.tokenization import PromptTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return PromptTokenizer(tiny_model_dir).tokenizer


def _stream(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for t in ids:
        deltas.append(detok.add([t]))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return detok, deltas


def test_multibyte_text_never_split(tokenizer):
    text = "caf\u00e9 \u4e16\u754c \U0001f642 na\u00efve \u00fcber"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Byte-level BPE: some of these characters span several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    _, deltas = _stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


@pytest.mark.parametrize("seed", range(5))
def test_random_ids_stream_is_stable_prefix(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(80)]
    final = tokenizer.decode(ids, skip_special_tokens=True)
    _, deltas = _stream(tokenizer, ids)
    sent = ""
    for d in deltas:
        sent += d
        d.encode("utf-8")  # valid UTF-8 (no lone surrogates)
        assert final.startswith(sent)  # nothing sent is ever taken back
    assert sent == final


def test_stop_string_across_tokens_is_trimmed_and_never_sent(tokenizer):
    text = "the image shows a red car on the table"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok, deltas = _stream(tokenizer, ids, stop=["red car"])
    assert detok.stopped
    assert "".join(deltas) == "the image shows a "
    assert not any("red" in d for d in deltas)
