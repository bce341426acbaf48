"""The Gated DeltaNet layer's sizes and what its step reads: shared by the torch reference
(model/gated_deltanet.py) and the fla path (model/gated_deltanet_fla.py), which import it, not each other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from decoder_svc.model.config import TextModelConfig


class LinearStateStep(Protocol):
    """What forward_batch reads of a step (model/linear_state.py's LinearStateStep is one: a Protocol, as
    that module builds on this one): the state pool, the chunked-form chunks and the single-token rows,
    or a CUDA graph's rows."""

    @property
    def pool(self) -> Any: ...  # .conv[layer], .recurrent[layer]: [slots, ...] tensors
    @property
    def chunks(self) -> Sequence[Any]: ...  # first_row, end_row, slot, fresh, snapshots
    @property
    def decode_rows(self) -> torch.Tensor | None: ...
    @property
    def decode_slots(self) -> torch.Tensor | None: ...
    @property
    def graph(self) -> Any: ...  # a CUDA graph's step (LinearGraphRows), else None



@dataclass(frozen=True)
class GatedDeltaNetShape:
    """One layer's sizes, as a text config names them (linear_* fields, rms_norm_eps, hidden_act)."""

    hidden_size: int
    num_k_heads: int    # linear_num_key_heads
    num_v_heads: int    # linear_num_value_heads (a multiple of num_k_heads)
    head_k_dim: int     # linear_key_head_dim
    head_v_dim: int     # linear_value_head_dim
    conv_kernel: int    # linear_conv_kernel_dim
    eps: float = 1e-6   # the gated RMSNorm's
    activation: str = "silu"  # the convolution's (hidden_act)

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads are not a multiple of {self.num_k_heads} key "
                             "heads")
        if self.activation != "silu":
            raise ValueError(f"activation {self.activation!r} is not supported; only silu")

    @classmethod
    def from_text_config(cls, text: dict[str, Any]) -> GatedDeltaNetShape:
        """The shape a text config (a dict, as config.json's text_config) gives its linear layers."""
        return cls(int(text["hidden_size"]), int(text["linear_num_key_heads"]),
                   int(text["linear_num_value_heads"]), int(text["linear_key_head_dim"]),
                   int(text["linear_value_head_dim"]), int(text["linear_conv_kernel_dim"]),
                   float(text.get("rms_norm_eps", 1e-6)), str(text.get("hidden_act", "silu")))

    @classmethod
    def from_model_config(cls, config: TextModelConfig) -> GatedDeltaNetShape:
        """The linear layers' shape of a parsed text config (its linear_* fields)."""
        if not config.linear_layers:
            raise ValueError("the text config has no linear-attention layer")
        return cls(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                   config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel,
                   config.rms_norm_eps, config.hidden_act)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def conv_state_shape(self, batch: int) -> tuple[int, int, int]:
        return batch, self.conv_dim, self.conv_kernel - 1

    def recurrent_state_shape(self, batch: int) -> tuple[int, int, int, int]:
        return batch, self.num_v_heads, self.head_k_dim, self.head_v_dim

    def state_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state of this layer (conv in `dtype`, recurrent in fp32)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4
