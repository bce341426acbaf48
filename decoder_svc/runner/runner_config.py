"""The runner's sizes and switches, as an engine's config sets them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.families.layout import ImageLayout
    from decoder_svc.engine.config import EngineConfig


@dataclass(frozen=True)
class RunnerConfig:
    """Sizes and switches of the runner."""

    device: str
    dtype: torch.dtype
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # default: half the GPU memory free after warm-up, or 512 MiB on CPU
    enforce_eager: bool = False  # no CUDA graphs
    progress: bool = True  # a progress bar while capturing graphs
    image_blocks: bool = False  # each image's tokens attend to each other whole (Gemma 3): key limits
    num_state_slots: int | None = None  # a hybrid stack's state slots (None: max_num_seqs)
    num_state_snapshots: int = 0  # ...and its snapshot slots after them (prefix reuse)
    deepstack_levels: int = 0  # DeepStack levels of its image rows (Qwen3-VL's; the graphs' level buffer)
    piecewise_graphs: bool = False  # a hybrid stack's longer prefill steps in piecewise graphs

    @classmethod
    def for_engine(cls, config: EngineConfig, device: str, dtype: torch.dtype, layout: ImageLayout,
                   eager: bool = False) -> RunnerConfig:
        """The runner's sizes and switches for an engine. Where images attend bidirectionally, an image
        (a block of one) larger than the token budget runs whole, over the budget: the buffers hold one
        more."""
        tokens = config.max_num_batched_tokens
        if layout.bidirectional_images:
            tokens += layout.largest_image_run
        return cls(device, dtype, config.block_size, config.max_num_seqs, tokens, config.num_kv_blocks,
                   config.kv_cache_bytes, config.enforce_eager or eager,
                   image_blocks=layout.bidirectional_images, num_state_slots=config.num_state_slots,
                   num_state_snapshots=cls.snapshots_for(config), deepstack_levels=layout.deepstack_levels,
                   piecewise_graphs=config.piecewise_graphs)

    @staticmethod
    def snapshots_for(config: EngineConfig) -> int:
        """A hybrid stack's snapshot slots: num_state_snapshots (None: max_num_seqs), none without prefix
        caching."""
        if not config.enable_prefix_caching:
            return 0
        return config.max_num_seqs if config.num_state_snapshots is None else config.num_state_snapshots

    @property
    def state_slots(self) -> int:
        """State slots a hybrid stack gets: num_state_slots, else one per running request."""
        return self.num_state_slots or self.max_num_seqs
