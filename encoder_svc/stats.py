"""The encoder service's one stats record (see common/stats.py): GetStats, /metrics and the log line all
read it. Field names are the API's (EncoderStats in encoder.proto); metrics that existed before the
record keep their names (`metric=`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.stats import stat, summary

# What the periodic log line shows.
_LOGGED = ("entries", "hits", "misses", "evictions", "active_leases", "encodes", "queue_depth")


@dataclass
class EncoderStats:
    """The embedding cache, the vision worker and the service's counters, read together."""

    cache_bytes_used: int = stat("Arena bytes holding entries", "gauge")
    cache_bytes_capacity: int = stat("Arena capacity in bytes", "gauge")
    entries: int = stat("Cached embeddings", "gauge", metric="cache_entries")
    hits: int = stat("Embedding cache hits", metric="cache_hits")
    misses: int = stat("Embedding cache misses", metric="cache_misses")
    evictions: int = stat("Embedding cache evictions", metric="cache_evictions")
    leased_bytes: int = stat("Bytes pinned by leases", "gauge", metric="cache_leased_bytes")
    active_leases: int = stat("Leases held now", "gauge")
    encodes: int = stat("Images run through the vision tower", metric="images_encoded")
    images_per_s: float = stat("Vision-tower throughput since start, images/s", "gauge", default=0.0)
    expired_leases: int = stat("Leases that expired unreleased")
    inflight_dedups: int = stat("Requests that joined a running encode")
    prefetches: int = stat("Images asked for ahead of their prefill (Prefetch, or Encode with prefetch)")
    # images_encoded / vision_batches is the mean batch: it follows the queue up to --max-batch-images
    vision_batches: int = stat("Vision-tower batches run")
    queue_depth: int = stat("Images waiting for the vision tower", "gauge")
    cuda_graphs: int = stat("1 when demand batches replay CUDA graphs of the tower", "gauge")
    tower_graphs: int = stat("CUDA graphs of the vision tower kept now", "gauge")
    device_memory_allocated_bytes: int = stat("Device bytes held by tensors (torch's allocator; 0 on a CPU)",
                                              "gauge")
    device_memory_reserved_bytes: int = stat("Device bytes torch's allocator holds: tensors, its cache, "
                                             "CUDA graphs' pools (0 on a CPU)", "gauge")
    decode_processes: int = stat("Image decode processes running (0: images decode in the server's threads)",
                                 "gauge")
    decode_restarts: int = stat("Image decode processes replaced after they died")
    # Where Encodes' time goes (encoder_svc/stages.py): seconds per stage summed over `encode_calls`
    # Encodes; the stages of one Encode add up to its latency.
    stage_seconds: dict = stat("Seconds of Encode time per stage (receive, decode, queue, preprocess, "
                               "tower, handoff)", "labels", label="stage", metric="encode_stage_seconds")
    encode_calls: int = stat("Encode RPCs answered (the stage sums' count)")
    tower_thread_seconds: dict = stat("Seconds of the vision tower's thread per phase (idle, prepare_wait, "
                                      "launch, store, fence), summed over vision_batches", "labels",
                                      label="phase", metric="tower_thread_seconds")
    tower_gpu_seconds: float = stat("Device seconds of finished vision-tower batches (CUDA events; 0 on "
                                       "a CPU)", default=0.0)
    model_fingerprint: str = stat("The checkpoint's fingerprint", "info", default="")
    device: str = stat("Where the tower runs", "info", default="")
    transports: str = stat("Transports this encoder hands out, comma-separated", "info", default="")

    def log_line(self) -> str:
        """The compact form for the service's log."""
        return summary(self, _LOGGED)


def device_memory(device: torch.device) -> dict[str, int]:
    """The record's device-memory fields for `device` (torch's allocator; zeros on a CPU). No sync."""
    if device.type != "cuda":
        return {"device_memory_allocated_bytes": 0, "device_memory_reserved_bytes": 0}
    return {"device_memory_allocated_bytes": torch.cuda.memory_allocated(device),
            "device_memory_reserved_bytes": torch.cuda.memory_reserved(device)}
