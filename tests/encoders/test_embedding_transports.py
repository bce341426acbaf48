"""`--embedding-transports`: which transports a decoder asks its encoders for, in order, with inline
always the last resort; an unknown name or one this process cannot read is refused with the reason."""

from __future__ import annotations

import argparse

import pytest

from common.pb import common_pb2
from common.transport import nixl as nixl_transport
from common.transport.importer import accepted_transports, readable_transports, transport_list_names
from decoder_svc.config import EncoderLinkConfig, transport_names

INLINE, SHM, NIXL = common_pb2.TRANSPORT_INLINE, common_pb2.TRANSPORT_SHM, common_pb2.TRANSPORT_NIXL


def test_by_default_every_readable_transport_is_asked_for():
    assert accepted_transports(None, "cpu") == readable_transports("cpu")
    assert accepted_transports(None, "cpu")[-1] == INLINE


def test_the_given_order_is_kept_and_inline_comes_last_once():
    assert accepted_transports(["inline"], "cpu") == [INLINE]
    if SHM in readable_transports("cpu"):
        assert accepted_transports(["shm", "shm"], "cpu") == [SHM, INLINE]
        assert accepted_transports(["inline", "shm"], "cpu") == [INLINE, SHM]
    if nixl_transport.nixl_installed():
        assert accepted_transports(["nixl"], "cpu") == [NIXL, INLINE]
        assert transport_list_names(accepted_transports(["nixl"], "cpu")) == "nixl,inline"


def test_unknown_or_unreadable_transports_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown embedding transport 'tcp'"):
        accepted_transports(["tcp"], "cpu")
    with pytest.raises(ValueError, match="'cuda_ipc' cannot be read here: it needs a CUDA device"):
        accepted_transports(["cuda_ipc"], "cpu")


def test_nixl_without_the_package_is_refused(monkeypatch):
    monkeypatch.setattr(nixl_transport, "nixl_installed", lambda: False)
    with pytest.raises(ValueError, match="nixl extra is not installed"):
        accepted_transports(["nixl"], "cpu")


@pytest.mark.parametrize("text, names", [("nixl", "nixl"), ("nixl, inline", "nixl,inline"),
                                         ("shm,cuda_ipc,", "shm,cuda_ipc")])
def test_the_flag_parses_a_comma_separated_list(text, names):
    assert transport_names(text) == names
    assert EncoderLinkConfig(addresses=["a:1"], transports=text).transport_list == names.split(",")


@pytest.mark.parametrize("text", ["", ",", "tcp", "nixl,rdma"])
def test_the_flag_refuses_other_names(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected transports from cuda_ipc,shm,nixl,inline"):
        transport_names(text)
