"""Encoder option defaults shared by the CLI and the service (a module without torch, so that the CLI
can check its arguments before the heavy imports)."""

from __future__ import annotations

import os

from common.vision import PREPROCESS_MODES  # noqa: F401 - the CLI's choices, defined with the tower

# Seconds an unreleased lease lives (the CLI's --lease-ttl and EmbeddingCache's default).
DEFAULT_LEASE_TTL_S = 60.0

# Seconds a file sent ahead (a decoder's Prefetch with needed_now) is produced for a request whose ask has
# not come yet (the CLI's --sent-ahead-claim): past it, with nobody else waiting, its production stops.
DEFAULT_SENT_AHEAD_CLAIM_S = 20.0

# Most estimated seconds of vision tower one image may cost (the CLI's --max-image-seconds; 0: no cap).
DEFAULT_MAX_IMAGE_SECONDS = 120.0

# Most images per tower batch. The batch follows the queue up to this; past ~32 CLIP-L/336 images the
# tower's throughput on an H200 grows little while a batch's latency keeps growing.
DEFAULT_MAX_BATCH_IMAGES = 32



def default_preprocess_threads() -> int:
    """Threads for image preprocessing: the host's cores less one (the tower's and the RPCs'), 1 to 16."""
    return max(1, min(16, (os.cpu_count() or 2) - 1))


# Below this many cores the decode processes compete with the server for too few cores: measured on a
# 2-core host, one process cost more server CPU per image (the pool's round trip) than it took off.
MIN_CORES_FOR_DECODE_PROCESSES = 4


def default_decode_processes() -> int:
    """Processes decoding and hashing image bytes (0: the server's threads): the cores this process may
    use less one (the server's own), at most 8; none on hosts of fewer than 4 cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return 0 if cores < MIN_CORES_FOR_DECODE_PROCESSES else min(8, cores - 1)
