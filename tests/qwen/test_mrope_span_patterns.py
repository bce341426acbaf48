"""M-RoPE positions from a pattern per grid (issue 65: a video's groups share one grid; each span was a
meshgrid of its own): the same positions as computing each span afresh."""

from __future__ import annotations

import random

import numpy as np

from common.families.qwen2_5_vl.layout import mrope_positions, span_pattern


def _afresh(num_tokens: int, images: list[tuple], merge_size: int) -> tuple[np.ndarray, int]:
    """The computation before issue 65, span by span (the reference)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, next_pos = 0, 0
    for offset, (t, h, w), *rest in sorted(images, key=lambda span: span[0]):
        interval = rest[0] if rest else 1
        text = offset - cursor
        out[:, cursor:offset] = np.arange(next_pos, next_pos + text)
        next_pos += text
        gh, gw = h // merge_size, w // merge_size
        temporal = ((np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64) if rest
                    else np.arange(t))
        tt, hh, ww = np.meshgrid(temporal, np.arange(gh), np.arange(gw), indexing="ij")
        n = t * gh * gw
        out[0, offset:offset + n] = tt.reshape(-1) + next_pos
        out[1, offset:offset + n] = hh.reshape(-1) + next_pos
        out[2, offset:offset + n] = ww.reshape(-1) + next_pos
        next_pos += max(gh, gw) if n else 0
        cursor = offset + n
    out[:, cursor:] = np.arange(next_pos, next_pos + num_tokens - cursor)
    top = int(out.max()) if num_tokens else -1
    return out, top + 1 - num_tokens


def _prompt(rng: random.Random) -> tuple[int, list[tuple]]:
    spans, offset = [], rng.randrange(0, 6)
    for _ in range(rng.randrange(0, 5)):
        t = rng.choice((1, 1, 2, 3))
        h, w = 2 * rng.randrange(1, 6), 2 * rng.randrange(1, 6)
        if rng.random() < 0.5:
            spans.append((offset, (t, h, w)))
        else:  # a video span, its interval as Qwen2.5-VL's seconds x tokens per second makes it
            spans.append((offset, (t, h, w), rng.choice((1.0, 0.5, 2.0, 25 / 13))))
        offset += t * (h // 2) * (w // 2) + rng.randrange(0, 4)
    return offset + rng.randrange(1, 5), spans


def test_the_same_positions_as_each_span_afresh():
    rng = random.Random(0)
    for _ in range(200):
        num_tokens, spans = _prompt(rng)
        got, delta = mrope_positions(num_tokens, spans, 2)
        want, want_delta = _afresh(num_tokens, spans, 2)
        assert got.dtype == np.int64 and np.array_equal(got, want) and delta == want_delta


def test_a_videos_groups_share_one_pattern():
    span_pattern.cache_clear()
    groups = [(10 + k * 20, (1, 8, 8), 2.0) for k in range(30)]  # 16 tokens a group, 4 of text between
    positions, _ = mrope_positions(10 + 30 * 20 + 3, groups, 2)
    assert span_pattern.cache_info().misses == 1 and span_pattern.cache_info().hits == 29
    assert np.array_equal(positions, _afresh(10 + 30 * 20 + 3, groups, 2)[0])
    pattern, _ = span_pattern(1, 8, 8, 2, 2.0)
    assert not pattern.flags.writeable  # shared: nobody may change it
