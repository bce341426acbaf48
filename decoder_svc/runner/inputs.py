"""What crosses the seam between the engine and the model runner: plain data, no scheduler objects.

The engine turns its scheduler's output into a ModelInput (one SequenceInput per scheduled chunk); the
runner turns that into device tensors, runs the model and samples, and answers with a ModelOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from decoder_svc.runner.sampler import SamplerOutput, SamplingRow

# A token id the engine does not know yet: the previous step samples it and the runner takes it from that
# step's output on the device (asynchronous scheduling). Only a sequence's last token may be pending.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a step: tokens [start, start + len(token_ids)) and where they go."""

    token_ids: list[int]  # the last one may be PENDING_TOKEN (then `sampling` names the request)
    start: int  # position of token_ids[0]
    block_table: list[int]  # physical KV blocks of the sequence, covering every token up to the chunk's end
    num_prompt_tokens: int  # image slots exist only below this position (generated ids are always text)
    image_rows: list[torch.Tensor] = field(default_factory=list)  # rows of the chunk's image tokens, in order
    sampling: SamplingRow | None = None  # None: a prefill chunk short of the last token (no logits)
    # M-RoPE: the request's prompt positions [3, num_prompt_tokens] (shared, not copied) and the offset
    # of generated tokens' positions from their index. None: 1D positions (the token's index).
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    # The tables of KV cache groups 1.. (a hybrid model's sliding layers; block_table is group 0's), as
    # long as block_table: entry i holds tokens [i * block_size, (i + 1) * block_size), 0 where freed.
    group_tables: list[list[int]] = field(default_factory=list)
    lora_slot: int = 0  # the LoRA adapter slot its rows run with (model/lora/); 0: the base model
    # A hybrid stack's state slot of the request (model/linear_state.py); -1: a model without one
    state_slot: int = -1
    # (tokens into the chunk, snapshot slot): where the linear layers copy the state into a snapshot slot
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed for this sequence in the step."""
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """Context length once the step is done."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class ModelInput:
    """Everything the runner computes in one step."""

    sequences: list[SequenceInput]
    finished_request_ids: list[str] = field(default_factory=list)  # ended: drop their per-request state
    # (group, source block, destination block): KV blocks copied before the step runs (a prompt's last,
    # partial block, copied for each sample forked from it: engine/fanout.py)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # (source slot, destination slot): a hybrid stack's state slots copied before the step runs (a
    # snapshot into the slot of a request that resumes from it: engine/state_snapshots.py)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the step."""
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_plain_decode(self) -> bool:
        """One text token per sequence: the shape CUDA graphs are captured for."""
        return all(s.num_tokens == 1 and not s.image_rows for s in self.sequences)


@dataclass(frozen=True)
class ModelOutput:
    """One sampled token (and optional logprobs) per sequence that had `sampling`, in order."""

    sampled: SamplerOutput
