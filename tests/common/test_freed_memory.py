"""Megabyte blocks stay on the heap between requests (common/freed_memory.reuse_freed_blocks): counted in
minor page faults of a fresh process, which glibc's defaults pay again for every request."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from common import freed_memory

_REQUESTS = textwrap.dedent("""
    import resource, sys
    from common.freed_memory import reuse_freed_blocks
    if sys.argv[1] == "reuse":
        assert reuse_freed_blocks()
    for _ in range(2):  # the first requests fault in what they use
        held = [bytearray(3_200_000) for _ in range(3)]
        del held
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a request's copies of a 3.1 MB image: wire bytes, message, pixels
        held = [bytearray(3_200_000) for _ in range(3)]
        del held
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _page_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _REQUESTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(freed_memory._MALLOPT is None, reason="not glibc: no mallopt")
def test_repeated_megabyte_requests_fault_no_fresh_pages():
    default, reused = _page_faults("default"), _page_faults("reuse")
    assert default > 20 * 700  # glibc's defaults: fresh pages for each 3.2 MB block, every request
    assert reused < default / 20
