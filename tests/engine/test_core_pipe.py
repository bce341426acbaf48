"""The engine core pipe's whole-message reader (decoder_svc/core_pipe.py): the Connection's own wire
format, large and small messages, EOF, and a plain os.pipe."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from decoder_svc.core_pipe import MessageReader


def test_reads_what_connection_send_wrote_large_and_small_in_order():
    ours, theirs = multiprocessing.Pipe()
    big = bytes(range(256)) * 12_000  # 3 MB: many socket-buffer fills
    messages = [("small", 1), {"files": [big, big[:17]]}, b"", "last"]
    sender = threading.Thread(target=lambda: [theirs.send(m) for m in messages])
    sender.start()
    reader = MessageReader(ours)
    try:
        assert [reader.recv() for _ in messages] == messages
    finally:
        sender.join()
        reader.close()
    ours.send("still usable")  # the reader closed its own descriptor only
    assert theirs.recv() == "still usable"


def test_eof_when_the_other_end_is_gone():
    ours, theirs = multiprocessing.Pipe()
    theirs.send("bye")
    theirs.close()
    reader = MessageReader(ours)
    assert reader.recv() == "bye"
    with pytest.raises(EOFError):
        reader.recv()
    reader.close()


def test_a_one_way_pipe_falls_back_to_connection_recv():
    ours, theirs = multiprocessing.Pipe(duplex=False)  # os.pipe: not a socket
    reader = MessageReader(ours)
    theirs.send([1, 2, 3])
    assert reader.recv() == [1, 2, 3]
    reader.close()
