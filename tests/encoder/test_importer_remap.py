"""A decoder outlives encoder restarts: the new arena is mapped fresh and the old mapping let go.

Encoders are child processes (tests/encoder/test_shm_sweeper.ShmOwner) filling their arena with one
float32 value; this process reads through the importer like a decoder.
"""

from __future__ import annotations

import gc
import secrets

import pytest
import torch

from common.pb import common_pb2
from common.transport import importer, shm

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs /dev/shm")

N = 8  # floats per embedding


def _ref(name: str, capacity: int) -> common_pb2.EmbeddingRef:
    return common_pb2.EmbeddingRef(dtype=common_pb2.DTYPE_FLOAT32, shape=[N], nbytes=4 * N,
                                   shm=common_pb2.ShmLocation(name=name, offset=0, arena_nbytes=capacity))


def _mapped(name: str) -> bool:
    """True while this process still maps /dev/shm/name (its pages stay allocated until then)."""
    with open("/proc/self/maps") as maps:
        return any(line.split()[5:6] == [str(shm.SHM_DIR / name)] for line in maps)




@pytest.fixture(autouse=True)
def _no_cached_mappings():
    """Each test starts and ends with an empty reader cache (other tests may have left mappings)."""
    for name in list(shm._readers):
        shm.forget_segment(name)
    yield
    for name in list(shm._readers):
        shm.forget_segment(name)


def test_restarted_encoder_under_a_new_name_replaces_the_old_mapping(owners):
    first = owners(fill=1.0)
    view = importer.import_embedding(_ref(first.name, first.capacity), source="enc-a:50051")
    assert torch.equal(view, torch.full((N,), 1.0))
    assert importer.open_mappings() == 1 and _mapped(first.name)
    del view
    first.kill()  # its segment is still in /dev/shm: only the source tells us it is superseded

    second = owners(fill=2.0)
    assert second.name != first.name
    view = importer.import_embedding(_ref(second.name, second.capacity), source="enc-a:50051")
    assert torch.equal(view, torch.full((N,), 2.0))
    gc.collect()
    assert importer.open_mappings() == 1, "the dead encoder's arena must be dropped, not kept mapped"
    assert not _mapped(first.name) and _mapped(second.name)


def test_old_mapping_outlives_its_drop_while_a_view_is_in_use(owners):
    first = owners(fill=1.0)
    held = importer.import_embedding(_ref(first.name, first.capacity), source="enc-b:50051")
    first.kill()
    second = owners(fill=2.0)
    importer.import_embedding(_ref(second.name, second.capacity), source="enc-b:50051")
    gc.collect()
    assert importer.open_mappings() == 1
    assert _mapped(first.name) and torch.equal(held, torch.full((N,), 1.0)), "never unmap under a view"
    del held
    gc.collect()
    assert not _mapped(first.name)


def test_same_name_new_incarnation_is_mapped_fresh(owners):
    name = f"{shm.SEGMENT_PREFIX}test-{secrets.token_hex(4)}-fixed"
    first = owners(name=name, fill=1.0)
    assert torch.equal(importer.import_embedding(_ref(name, first.capacity)), torch.full((N,), 1.0))
    first.kill()
    assert shm.sweep_stale_segments(name) == [name]  # what the restarting encoder does first

    second = owners(name=name, fill=5.0)  # the same name, a new file (new inode)
    opens = shm.shm_opens
    got = importer.import_embedding(_ref(name, second.capacity))
    assert torch.equal(got, torch.full((N,), 5.0)), "read the dead incarnation's bytes"
    assert shm.shm_opens == opens + 1 and importer.open_mappings() == 1
    again = importer.import_embedding(_ref(name, second.capacity))
    assert again.data_ptr() == got.data_ptr() and shm.shm_opens == opens + 1, "still mapped once"
    del got, again
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert sum(str(shm.SHM_DIR / name) in line for line in maps) == 1, "the old incarnation is unmapped"


def test_without_source_a_gone_segment_is_dropped_when_a_new_one_is_mapped(owners):
    first = owners(fill=1.0)
    importer.import_embedding(_ref(first.name, first.capacity))
    first.stop()  # a clean shutdown unlinks the segment
    second = owners(fill=2.0)
    assert torch.equal(importer.import_embedding(_ref(second.name, second.capacity)), torch.full((N,), 2.0))
    gc.collect()
    assert importer.open_mappings() == 1 and not _mapped(first.name)
    with pytest.raises(FileNotFoundError):  # a ref into the gone arena is refused, not read stale
        importer.import_embedding(_ref(first.name, first.capacity))


def test_a_source_shared_arena_is_kept(owners):
    """Two names for one encoder (e.g. host and IP): one moving on does not drop what the other reads."""
    owner = owners(fill=3.0)
    importer.import_embedding(_ref(owner.name, owner.capacity), source="enc-c:1")
    importer.import_embedding(_ref(owner.name, owner.capacity), source="10.0.0.3:1")
    other = owners(fill=4.0)
    importer.import_embedding(_ref(other.name, other.capacity), source="enc-c:1")
    assert importer.open_mappings() == 2
    assert torch.equal(importer.import_embedding(_ref(owner.name, owner.capacity), source="10.0.0.3:1"),
                       torch.full((N,), 3.0))
