"""Incremental detokenization that never emits text it may have to take back.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding then yields U+FFFD. We keep
a window of ids, emit only text that does not end in U+FFFD, and hold back the last len(stop) - 1
characters while stop strings are set, so a stop string is trimmed before any of it is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and finds stop strings."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start: text before it is settled
        self._read_offset = 0  # ids up to here are in self.text
        self.text = ""  # settled text (stop string trimmed once found)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int], check_stop: bool = True) -> str:
        """Append tokens; return the text that is now safe to send. Sets `stopped` on a stop string
        (looked for only with check_stop: min_tokens turns it off for an output's first tokens)."""
        if self.stopped:
            return ""
        before = len(self.text)
        for tid in token_ids:
            self.ids.append(tid)
            prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
            new = self._decode(self.ids[self._prefix_offset:])
            if len(new) > len(prefix) and not new.endswith(_REPLACEMENT):
                self.text += new[len(prefix):]
                self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if check_stop:
            self._check_stop(before)
        return self._take(len(self.text) if self.stopped else len(self.text) - self._hold)

    def finish(self) -> str:
        """Flush everything held back (an unfinished character decodes to U+FFFD, still valid UTF-8)."""
        if not self.stopped:
            before = len(self.text)
            prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
            self.text += self._decode(self.ids[self._prefix_offset:])[len(prefix):]
            self._read_offset = len(self.ids)
            self._check_stop(before)
        return self._take(len(self.text))

    def _check_stop(self, before: int) -> None:
        if not self.stop or self.stopped:
            return
        # A stop string may begin inside text settled earlier: look back len(stop) - 1 characters.
        lo = max(0, before - self._hold)
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _take(self, limit: int) -> str:
        limit = max(limit, self._emitted)
        delta = self.text[self._emitted:limit]
        self._emitted = limit
        return delta
