"""Giving host memory back after large tower inputs (issue 38: the encoder kept its peak RSS).

A 4096x4096 image is 48 MiB of pixels and, prepared for Qwen2.5-VL, 300 MB of fp32 patch rows; the
tower's activations for its 16384 tokens come on top. glibc keeps such freed blocks (common/
freed_memory.py), so without a trim the encoder stays as large as its largest batch. A trim walks every
arena, so it runs only after a batch whose inputs reach LARGE_JOB_BYTES, not after every small one.
"""

from __future__ import annotations

import torch

from common.freed_memory import LARGE_JOB_BYTES, release_freed_memory


def input_nbytes(prepared: object) -> int:
    """Host bytes of one prepared tower input: a tensor, or the tensors of a Qwen-VL prepared input."""
    if isinstance(prepared, torch.Tensor):
        return prepared.numel() * prepared.element_size()
    parts = (getattr(prepared, "pixel_values", None), getattr(prepared, "raw", None),
             getattr(prepared, "frames", None))
    return sum(input_nbytes(t) for t in parts if t is not None)


def return_memory_after(nbytes: int) -> bool:
    """Give freed memory back to the system after a batch whose inputs took `nbytes` (once they are
    dropped), when that was large; True when it did."""
    return nbytes >= LARGE_JOB_BYTES and release_freed_memory()
