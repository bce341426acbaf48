"""A family's language model, as data: the text backbones its checkpoints' text configs name, and where
its checkpoints keep the language model's weights.

The decoder interprets these (decoder_svc/model/config.py reads a text config through its backbone,
decoder_svc/model/loader.py maps weight names through the prefixes); its one shared decoder layer reads
the resulting TextModelConfig's fields. A family declares them in its folder's `text.py` and names that
TextSpec in its FAMILY (`text`); a family whose language model is an existing backbone reuses that
backbone's object (vLLM's idea: a model names a registered text backbone, with its own weight mapper).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types values
LINEAR = "linear_attention"  # a linear-attention (Gated DeltaNet) layer of a hybrid stack
# A text config without model_type (older LLaVA exports) is this backbone's.
DEFAULT_TEXT_MODEL_TYPE = "llama"

# The language model at a checkpoint's top level, as *ForCausalLM classes save it.
TOP_LEVEL_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.layers.", "layers."),
    ("model.embed_tokens.", "embed_tokens."),
    ("model.norm.", "norm."),
    ("lm_head.", "lm_head."),
)

# (text config, its rope dict) -> (the rope dict to read on, TextModelConfig fields by name). Raises
# CheckpointError for a config the backbone cannot serve.
FieldReader = Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class TextBackbone:
    """One language-model architecture the shared decoder layer runs: its switches, and how its text
    config is read where that differs from Llama's. Defaults are Llama's."""

    name: str
    model_types: tuple[str, ...]  # text config `model_type` values it reads
    qkv_bias: bool | None = None  # q/k/v projections' bias; None: the config's attention_bias
    o_bias: bool | None = None    # the output projection's bias; None: the config's attention_bias
    qk_norm: bool = False         # RMSNorm over each head of q and k before the rotary embedding
    partial_rotary: bool = False  # a partial_rotary_factor below 1 is served (else refused)
    # ...with M-RoPE too: the sections then split the rotated dims' frequencies (else refused)
    partial_mrope: bool = False
    activations: tuple[str, ...] = ("silu",)  # MLP gate activations it serves
    # A config key that must be true for `sliding_window` to apply (configs that carry a window they do
    # not use); None: the window applies whenever it is set.
    window_switch: str | None = None
    # Its own fields (norm style, per-layer windows, ...), read before the shared rope parsing.
    read_fields: FieldReader | None = None


@dataclass(frozen=True)
class TextSpec:
    """A family's language model: the backbones its text configs may name, and the weight-name prefixes
    of its checkpoints (checkpoint prefix, ours), e.g. ("model.language_model.", "")."""

    backbones: tuple[TextBackbone, ...]
    weight_prefixes: tuple[tuple[str, str], ...]
