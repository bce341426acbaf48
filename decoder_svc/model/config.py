"""The language model's shape, parsed from a Hugging Face text config through the text backbone its
model_type names (a family declares its backbones in its folder's text.py: common/families/text.py).
Architectural differences are fields the shared layers read, not model-type branches there."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from common.checkpoint import CheckpointError
from common.families.registry import supported_text_model_types, text_backbone
from common.families.text import DEFAULT_TEXT_MODEL_TYPE, FULL, LINEAR, SLIDING, TextBackbone
from decoder_svc.model.longrope import longrope_fields

__all__ = ["FULL", "LINEAR", "SLIDING", "TextModelConfig"]

_ROPE_TYPES = {"default", "linear", "llama3", "longrope"}


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
    # M-RoPE: frequencies per (temporal, height, width) axis; empty for 1D rotary.
    mrope_section: tuple[int, ...] = ()
    # Interleaved M-RoPE: the axes take frequencies in turn (t, h, w, t, h, w, ...), not three blocks.
    mrope_interleaved: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary embedding
    # All defaults below are Llama's; the backbones that differ set them (common/families/*/text.py).
    norm_unit_offset: bool = False  # norms scale by (1 + weight), the product in fp32 before the cast
    embed_scale: float | None = None  # embeddings times this (as a tensor in their dtype): sqrt(hidden)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim ** -0.5)
    # Per layer, "sliding_attention" (keys within sliding_window of the query), "full_attention", or
    # "linear_attention" (a Gated DeltaNet layer of a hybrid stack: no KV, a state; the linear_* fields);
    # empty: every layer full (a window on every layer is then served by capping the length, see
    # max_model_len).
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # the sliding layers' rope base (default frequencies, no scaling)
    hidden_act: str = "silu"  # the MLP's gate activation: silu or gelu_pytorch_tanh
    sandwich_norms: bool = False  # norms after attention and after the MLP too, before the residual adds
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Partial rotary (partial_rotary_factor < 1, e.g. 0.75): only the first rotary_dim dims of each head
    # are rotated, the rest pass through; None: all head_dim. The cos/sin table is rotary_dims wide, and
    # the rotary ops take the rotated width from the table's.
    rotary_dim: int | None = None
    # LongRoPE's attention scaling: cos and sin are multiplied by it (HF's attention_scaling); 1 elsewhere.
    rope_attention_factor: float = 1.0
    # Gated attention output (Qwen3-Next, Qwen3.5): q_proj gives 2 * head_dim per head, each head's query
    # then its gate; the attention output is multiplied by sigmoid(gate) before o_proj.
    attn_output_gate: bool = False
    # The linear-attention layers' shape (decoder_svc/model/gated_deltanet.py's GatedDeltaNetShape); 0
    # where the stack has none.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # A mixture-of-experts stack (decoder_svc/model/moe.py): each MoE layer's MLP is num_experts SwiGLU
    # experts of width moe_intermediate_size, num_experts_per_tok of them per token, their router weights
    # renormalised to sum to one when moe_renormalize; the layers in dense_mlp_layers keep a dense MLP
    # (intermediate_size). num_experts 0: every MLP is dense. shared_expert_intermediate_size > 0: each MoE
    # layer also runs a shared SwiGLU expert of that width on every token, scaled by a sigmoid gate (Qwen3.5-
    # MoE, Qwen2-MoE's rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    dense_mlp_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    @property
    def attention_scale(self) -> float:
        """Softmax scale of q . k."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys older than it are masked), or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def layer_is_moe(self, layer: int) -> bool:
        """True when layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The indices of the linear-attention layers (a hybrid stack's; empty elsewhere)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The indices of the layers that attend over a KV cache (every layer but the linear ones)."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def has_sliding_layers(self) -> bool:
        """True when some layer attends through a window (the attention backend must mask it)."""
        return any(self.layer_window(i) for i in range(self.num_layers))

    @property
    def needs_offset_norm_ops(self) -> bool:
        """True when the model needs ops beyond Llama's ((1 + w) norms, tanh GELU): the kernels'
        ops class must have them (TorchOps and TritonOps do)."""
        return self.norm_unit_offset or self.hidden_act != "silu"

    def local_rope(self) -> TextModelConfig:
        """This config with the sliding layers' rope (its base, no scaling), for their cos/sin table."""
        return replace(self, rope_theta=self.local_rope_theta or self.rope_theta, rope_scaling={})

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head the rotary embedding rotates (the cos/sin table's width)."""
        return self.rotary_dim or self.head_dim

    @property
    def rope_type(self) -> str:
        """The RoPE variant: default, linear, llama3 or longrope."""
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def max_model_len(self) -> int:
        """The longest sequence we serve. A window on every layer caps it, as no kernel masks such a
        window yet; per-layer windows (layer_types) are masked by the attention.
        LongRoPE serves only original_max_position_embeddings (decoder_svc/model/longrope.py says why)."""
        longest = self.max_position_embeddings
        if self.rope_type == "longrope":
            longest = min(longest, int(self.rope_scaling["original_max_position_embeddings"]))
        if self.sliding_window and not self.layer_types:
            return min(longest, self.sliding_window)
        return longest

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> TextModelConfig:
        """Parse a text_config dict in either rope style (`rope_theta` or a `rope_parameters` dict), as
        the backbone its model_type names reads it."""
        model_type = cfg.get("model_type", DEFAULT_TEXT_MODEL_TYPE)
        backbone = text_backbone(model_type)
        if backbone is None:
            raise CheckpointError(f"unsupported language model {model_type!r}; "
                                  f"supported: {sorted(supported_text_model_types())}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        extra: dict[str, Any] = {}
        if backbone.read_fields is not None:
            rope, extra = backbone.read_fields(cfg, rope)
        act = extra.pop("hidden_act", cfg.get("hidden_act", "silu"))
        if act not in backbone.activations:
            raise CheckpointError(f"unsupported hidden_act {act!r} for {model_type}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("type", None) or rope.get("rope_type", "default")  # older configs say "type"
        mrope_section = tuple(int(x) for x in rope.pop("mrope_section", ()) or ())
        mrope_interleaved = bool(rope.pop("mrope_interleaved", False))
        if rope_type == "mrope":  # M-RoPE checkpoints' name for default frequencies over 3 axes
            rope_type = "default"
        partial = float(rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
        rotated = int(head_dim * partial)  # HF's int(head_dim * partial_rotary_factor)
        # the sections split the rotated frequencies (all of head_dim's but where partial M-RoPE is served)
        split = rotated if backbone.partial_mrope else head_dim
        if mrope_section and (len(mrope_section) != 3 or sum(mrope_section) != split // 2):
            what = "head_dim / 2" if split == head_dim else "the rotated dims / 2"
            raise CheckpointError(f"mrope_section {list(mrope_section)} must be 3 sections summing to "
                                  f"{what} = {split // 2}")
        rope["rope_type"] = rope_type
        if rope_type not in _ROPE_TYPES:
            raise CheckpointError(f"unsupported rope type {rope_type!r}; supported: {sorted(_ROPE_TYPES)}")
        if partial != 1.0 and not backbone.partial_rotary:
            raise CheckpointError("partial rotary embeddings are not supported")
        if rope_type == "longrope":
            rope, more = longrope_fields(cfg, rope, head_dim, partial)
            extra.update(more)
        # a stack with an MoE layer everywhere may have no dense width (Qwen3.5-MoE): its fields give one
        intermediate = extra.pop("intermediate_size") if "intermediate_size" in extra \
            else cfg["intermediate_size"]
        if partial != 1.0:
            if mrope_section and not backbone.partial_mrope:
                raise CheckpointError("M-RoPE with partial rotary embeddings is not supported")
            extra["rotary_dim"] = rotated
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=intermediate,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            **_attention_bias(cfg, backbone),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope if rope_type != "default" else {},
            sliding_window=_sliding_window(cfg, backbone),
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            qk_norm=backbone.qk_norm,
            hidden_act=act,
            **extra,
        )


def _attention_bias(cfg: dict[str, Any], backbone: TextBackbone) -> dict[str, bool]:
    """qkv_bias and o_bias: the backbone's where it fixes them, else the config's attention_bias (Llama's
    one switch for all four projections)."""
    attention_bias = bool(cfg.get("attention_bias", False))
    return dict(qkv_bias=attention_bias if backbone.qkv_bias is None else backbone.qkv_bias,
                o_bias=attention_bias if backbone.o_bias is None else backbone.o_bias)


def _sliding_window(cfg: dict[str, Any], backbone: TextBackbone) -> int | None:
    """The config's sliding_window, unless the backbone's switch for it is off (a window carried, unused)."""
    if backbone.window_switch is not None and not cfg.get(backbone.window_switch, False):
        return None
    return cfg.get("sliding_window")
