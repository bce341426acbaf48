"""The language model's shape, parsed from a Hugging Face text config (Llama, Mistral, Qwen2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.checkpoint import CheckpointError

_SUPPORTED = {"llama", "mistral", "qwen2", "qwen2_5_vl_text", "qwen2_5_vl", "qwen3_vl_text", "qwen3_vl"}
_QWEN2_LIKE = {"qwen2", "qwen2_5_vl_text", "qwen2_5_vl"}  # q/k/v biases, no o bias, an unused window
_QWEN3_LIKE = {"qwen3_vl_text", "qwen3_vl"}  # RMSNorm on each head of q and k, an unused window
_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class TextModelConfig:
    """Everything our decoder layers need to know about the checkpoint's language model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    # M-RoPE (Qwen2.5-VL): frequencies per (temporal, height, width) axis; empty for 1D rotary.
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL: the axes take interleaved frequencies (t, h, w, t, h, w, ...) instead of three blocks.
    mrope_interleaved: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary embedding

    @property
    def rope_type(self) -> str:
        """The RoPE variant: default, linear or llama3."""
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def max_model_len(self) -> int:
        """The longest sequence we serve (no sliding-window kernel yet, so the window caps it)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> TextModelConfig:
        """Parse a text_config dict in either rope style (`rope_theta` or a `rope_parameters` dict)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _SUPPORTED:
            raise CheckpointError(f"unsupported language model {model_type!r}; "
                                  f"supported: {sorted(_SUPPORTED)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("type", None) or rope.get("rope_type", "default")  # older configs say "type"
        mrope_section = tuple(int(x) for x in rope.pop("mrope_section", ()) or ())
        mrope_interleaved = bool(rope.pop("mrope_interleaved", False))
        if rope_type == "mrope":  # Qwen2.5-VL checkpoints' name for default frequencies over 3 axes
            rope_type = "default"
        if mrope_section and (len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2):
            raise CheckpointError(f"mrope_section {list(mrope_section)} must be 3 sections summing to "
                                  f"head_dim / 2 = {head_dim // 2}")
        rope["rope_type"] = rope_type
        if rope_type not in _ROPE_TYPES:
            raise CheckpointError(f"unsupported rope type {rope_type!r}; supported: {sorted(_ROPE_TYPES)}")
        if cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise CheckpointError("partial rotary embeddings are not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        qwen2 = model_type in _QWEN2_LIKE
        sliding = cfg.get("sliding_window")
        if (qwen2 or model_type in _QWEN3_LIKE) and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window they do not use
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers all four.
            qkv_bias=True if qwen2 else attention_bias,
            o_bias=False if qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope if rope_type != "default" else {},
            sliding_window=sliding,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            qk_norm=model_type in _QWEN3_LIKE,
        )
