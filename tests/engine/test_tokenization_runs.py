"""Placeholder spans from the runs the tokenizer wrote (issue 65: no scan of a long prompt's ids on the
request path), the same as the scan of the expanded ids finds."""

from __future__ import annotations

import pytest

from decoder_svc.tokenization import PlaceholderMismatchError, PromptTokenizer, VideoPromptLayout

BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


class _NoScan(list):
    """Ids that must not be read."""

    def __iter__(self):
        raise AssertionError("the expanded ids were scanned")


@pytest.fixture(scope="module")
def qwen(qwen_model_dir):
    return PromptTokenizer(qwen_model_dir)


CASES = [
    (f"{BLOCK}\nWhat is it?", [4], []),
    (f"{BLOCK}{BLOCK} two adjacent images", [4, 8], []),
    (f"a {BLOCK} b {BLOCK} c", [12, 4], []),
    (f"a clip {VIDEO} and what happens?", [], [VideoPromptLayout(1, 24)]),
    (f"{VIDEO} timed groups", [], [VideoPromptLayout(3, 4, (0.5, 1.5, 2.5))]),
    (f"{BLOCK} then {VIDEO} then {VIDEO}", [8],
     [VideoPromptLayout(2, 4, (0.0, 2.0)), VideoPromptLayout(1, 6)]),
]


@pytest.mark.parametrize(("prompt", "counts", "videos"), CASES)
def test_spans_from_the_written_runs_equal_the_scanned_ones(qwen, prompt, counts, videos):
    out = qwen.encode_prompt(prompt, image_token_counts=counts, videos=videos)
    runs = [qwen.layout.image_runs(c) for c in counts]
    assert out.placeholders == qwen._placeholders(out.token_ids, runs)  # the scan's answer
    assert out.video_spans == (qwen._video_spans(out.token_ids, videos) if videos else [])
    assert [p.length for p in out.placeholders] == counts
    for ph in out.placeholders:
        assert set(out.token_ids[ph.offset:ph.offset + ph.length]) == {qwen.image_token_id}
    for spans in out.video_spans:
        for span in spans:
            assert set(out.token_ids[span.offset:span.offset + span.length]) == {qwen.video_token_id}


def test_the_expanded_ids_are_not_scanned(qwen):
    videos = [VideoPromptLayout(2, 4, (0.0, 2.0))]
    text_ids = qwen.tokenizer(f"{BLOCK} then " + qwen._video_text(VideoPromptLayout(2, 1, (0.0, 2.0))))
    ids, image_found, video_found = qwen._repeat_runs(text_ids["input_ids"], [8], videos)
    runs = [qwen.layout.image_runs(8)]
    assert qwen._placeholders(_NoScan(ids), runs, image_found) == qwen._placeholders(ids, runs)
    assert qwen._video_spans(_NoScan(ids), videos, video_found) == qwen._video_spans(ids, videos)


def test_a_count_that_does_not_match_is_still_refused(qwen):
    with pytest.raises(PlaceholderMismatchError):
        qwen.encode_prompt(f"{BLOCK}{BLOCK} two images, one count", image_token_counts=[4])
    with pytest.raises(PlaceholderMismatchError):
        qwen.encode_prompt(f"{BLOCK} one image, two counts", image_token_counts=[4, 4])
