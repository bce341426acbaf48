"""NIXL is optional: nothing imports it until it is used, and without the package the encoder offers the
other transports, the decoder does not ask for NIXL, and a NIXL ref it gets anyway is refused cleanly
(the remote source then asks for the bytes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.pb import common_pb2
from common.transport import import_embedding, readable_transports
from common.transport import nixl as nixl_transport
from common.transport.arena import TensorArena
from common.transport.importer import can_import
from encoder_svc.refs import choose_transport, served_transports

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_imports_nixl_until_it_is_used():
    code = ("import sys, common.transport, encoder_svc.server, decoder_svc.encoders.remote_source\n"
            "from common.transport import readable_transports\n"
            "readable_transports('cpu')\n"
            "names = ('nixl', 'nixl_cu12', 'nixl_cu13')\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in names)\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.fixture
def no_nixl(monkeypatch):
    """This process as if no nixl package were installed."""
    monkeypatch.setattr(nixl_transport, "_MODULES", ("mmserve_no_such_nixl_package",))
    monkeypatch.setattr(nixl_transport, "_reader", None)


def test_without_the_package_nixl_is_neither_offered_nor_asked_for(no_nixl):
    assert not nixl_transport.nixl_installed()
    arena = TensorArena(1 << 16)
    assert nixl_transport.make_exporter(arena) is None  # the encoder logs why and goes on
    served = served_transports(arena, None)
    assert common_pb2.TRANSPORT_NIXL not in served
    # A caller that lists NIXL first gets the next transport it listed that is served.
    assert choose_transport([common_pb2.TRANSPORT_NIXL, common_pb2.TRANSPORT_INLINE], served) == \
        common_pb2.TRANSPORT_INLINE
    assert common_pb2.TRANSPORT_NIXL not in readable_transports("cpu")
    assert nixl_transport.known_agent("any") == ""


def test_a_nixl_ref_without_the_package_is_refused_cleanly(no_nixl):
    ref = common_pb2.EmbeddingRef(shape=[2, 4], dtype=common_pb2.DTYPE_FLOAT32, nbytes=32, lease_id="l")
    ref.nixl.agent_name, ref.nixl.agent_metadata = "mmserve-enc-1-x", b"md"
    ref.nixl.address, ref.nixl.arena_nbytes = 4096, 1 << 16
    assert not can_import(ref)  # the remote source asks for the bytes instead
    with pytest.raises(nixl_transport.NixlTransferError, match="no nixl package"):
        import_embedding(ref)


class _StuckAgent:
    """A NIXL agent whose READs never finish (as toward a host that stopped answering)."""

    backends = {"UCX": object()}

    def __init__(self) -> None:
        self.registered, self.removed = [], []

    def add_remote_agent(self, metadata):
        return metadata.decode()

    def remove_remote_agent(self, name):
        self.removed.append(name)

    def register_memory(self, tensor):
        self.registered.append(tensor.data_ptr())
        return tensor.data_ptr()

    def deregister_memory(self, reg):
        self.registered.remove(reg)

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, name):
        return _Handle()

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "PROC"


class _Handle:
    released = 0

    def release(self):
        _Handle.released += 1


def test_a_read_that_never_finishes_times_out_and_its_buffer_is_never_reused(monkeypatch):
    agent = _StuckAgent()
    monkeypatch.setattr(nixl_transport, "_new_agent", lambda name: agent)
    reader = nixl_transport.NixlReader()
    loc = common_pb2.NixlLocation(agent_name="enc", agent_metadata=b"enc", address=1 << 20, arena_nbytes=4096)
    with pytest.raises(nixl_transport.NixlTransferError, match="not done within"):
        reader.read(loc, 1024, source="e", timeout_s=0.01)
    assert _Handle.released == 1 and agent.removed == ["enc"] and reader.known_agent("e") == ""
    first = agent.registered[-1]
    with pytest.raises(nixl_transport.NixlTransferError):
        reader.read(loc, 1024, source="e", timeout_s=0.01)
    # The first buffer stays registered and is never handed to a second READ: a late write may land in it.
    assert len(agent.registered) == 2 and first in agent.registered and agent.registered[-1] != first
