"""Llama-family decoder layers (Llama, Mistral, Qwen2, Qwen3-VL, Gemma 3, Phi-4-mini) over flat token batches
and a paged KV cache. Where Gemma 3 differs, the layers read it from TextModelConfig's fields
(norm_unit_offset, sandwich_norms, per-layer windows and rope, hidden_act, embed_scale, ...); TorchOps and
TritonOps both have its (1 + w) norm and GeGLU.
Phi-4-mini's partial rotary and LongRoPE live in the cos/sin table alone (rotary_dims wide, its rows
scaled by rope_attention_factor): the rotary ops rotate as many dims as the table is wide.
Hybrid stacks (Qwen3.5): the layers cfg.layer_types marks "linear_attention" mix tokens with a Gated
DeltaNet (model/gated_deltanet.py) over per-request state slots (model/linear_state.py) instead of
attention over the KV cache; with cfg.attn_output_gate the attention's q projection gives each head's
query then its gate, and the output is multiplied by sigmoid(gate) before o_proj.

q/k/v are one projection (`qkv_proj`) and gate/up another (`gate_up_proj`), fused at load from the
checkpoint's separate tensors (loader.PACKED_MODULES): one matrix product each instead of three and
two. Norms, the residual adds, rotary embedding and SiLU-and-multiply go through `ops`: the torch
reference (CPU, tests) or fused Triton kernels (GPU), with the rounding points of Hugging Face's code.
"""

from __future__ import annotations

import torch
from torch import nn

from decoder_svc.model.attention import AttentionBackend, AttentionMetadata
from decoder_svc.model.batch_invariant import BatchInvariantMatmuls, invariant_matmuls_active
from decoder_svc.model.config import LINEAR, TextModelConfig
from decoder_svc.model.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
from decoder_svc.model.kv_groups import group_of_layer, layer_groups
from decoder_svc.model.linear_state import LinearStateStep
from decoder_svc.model.lora.batched import LoRASlots
from decoder_svc.model.mlp import MLP
from decoder_svc.model.moe import SparseMoE
from decoder_svc.model.ops import TorchOps
from decoder_svc.model.parallel import TensorParallel, all_reduce, gather_vocab
from decoder_svc.model.rope import cos_sin_table


class RMSNorm(nn.Module):
    """RMS norm computed in fp32 and cast back before the weight, as HF does; with `residual`, adds it
    first and returns the sum as the new residual (one fused kernel on the GPU). `unit_offset` (Gemma):
    scaled by (1 + weight) in fp32 instead (TorchOps.offset_rms_norm)."""

    def __init__(self, size: int, eps: float, ops: type[TorchOps], unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.unit_offset:
            return self.ops.offset_rms_norm(x, self.weight, self.eps, residual)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def make_norm(cfg: TextModelConfig, size: int, ops: type[TorchOps]) -> RMSNorm:
    """The config's norm over `size` features."""
    return RMSNorm(size, cfg.rms_norm_eps, ops, cfg.norm_unit_offset)


class SelfAttention(nn.Module):
    """GQA self-attention; the backend stores K/V and attends over the paged cache. Tensor-parallel
    (`reduce`): this rank's heads, and the o projection's partial outputs summed over the ranks."""

    def __init__(self, cfg: TextModelConfig, ops: type[TorchOps], reduce: bool = False,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = window  # a sliding layer's window (keys older than it are masked), else None
        # Gated output: q_proj's rows per head are the head's query then its gate (HF's layout)
        self.gate = cfg.attn_output_gate
        self.q_rows = self.q_size * (2 if self.gate else 1)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_rows + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.ops = ops
        if cfg.qk_norm:  # Qwen3, Gemma 3
            self.q_norm = make_norm(cfg, cfg.head_dim, ops)
            self.k_norm = make_norm(cfg, cfg.head_dim, ops)
        self.qk_norm = cfg.qk_norm
        self.reduce = reduce

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, cos_sin, kv_cache, meta, backend)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The block after the q/k/v product: (QK norm,) rotary, attention, o projection."""
        n, q_rows = qkv.shape[0], self.q_rows
        gate = None
        if self.gate:
            q_and_gate = qkv[:, :q_rows].view(n, self.num_heads, 2 * self.head_dim)
            q, gate = q_and_gate[..., :self.head_dim], q_and_gate[..., self.head_dim:]
        else:
            q = qkv[:, :q_rows].view(n, self.num_heads, self.head_dim)
        k = qkv[:, q_rows:q_rows + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_rows + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.norm_heads(q, k)
        out = backend.rotate_and_forward(q, k, v, self.ops.rotary, positions, cos_sin, kv_cache, meta,
                                         self.scale, window=self.window)
        out = out.reshape(n, self.q_size)
        if gate is not None:  # in the model's dtype, as HF
            out = out * torch.sigmoid(gate.reshape(n, self.q_size))
        out = self.ops.linear(out, self.o_proj)
        return all_reduce(out) if self.reduce else out

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_norm and k_norm over each head (one launch where the ops have qk_norm)."""
        if hasattr(self.ops, "qk_norm"):
            return self.ops.qk_norm(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                    self.q_norm.unit_offset)
        return _per_head(self.q_norm, q), _per_head(self.k_norm, k)


def _per_head(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """norm over the last dim of x [T, heads, head_dim] (a strided view of qkv: copied into rows)."""
    out, _ = norm(x.reshape(-1, x.shape[-1]))
    return out.view(x.shape)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual stream travels beside the hidden states so each
    residual add fuses into the norm that follows it, and each norm into the product it feeds
    (ops.norm_linear: one kernel at one row where that was measured faster).

    With cfg.sandwich_norms (Gemma 3) the attention and MLP outputs are normed too before their residual
    adds, and the norm before the MLP is `pre_feedforward_layernorm` (`post_attention_layernorm` then
    norms the attention's output, as HF names them). In a MoE stack (cfg.layer_is_moe) the MLP is a
    SparseMoE (model/moe.py). A hybrid stack's linear-attention layer mixes tokens with `linear_attn` (a
    Gated DeltaNet over the step's state slots) where the others attend."""

    def __init__(self, cfg: TextModelConfig, ops: type[TorchOps], reduce: bool = False,
                 layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.linear = bool(cfg.layer_types) and cfg.layer_types[layer] == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(GatedDeltaNetShape.from_model_config(cfg))
        else:
            self.self_attn = SelfAttention(cfg, ops, reduce, cfg.layer_window(layer))
        self.moe = cfg.layer_is_moe(layer)
        self.mlp = SparseMoE(cfg, ops, reduce) if self.moe else MLP(cfg, ops, reduce)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, ops)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, ops)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, ops)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, ops)

    @property
    def sliding(self) -> bool:
        """True for a sliding-window layer (it takes the local rope table)."""
        return not self.linear and self.self_attn.window is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend, linear_state: LinearStateStep | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.linear:
            if linear_state is None:
                raise ValueError("a linear-attention layer needs the step's state slots (linear_state)")
            h, residual = self.input_layernorm(x, residual)
            h = self.linear_attn.forward_batch(h, linear_state, self.layer)
        else:
            qkv, residual = self.norm_into(self.input_layernorm, x, residual, self.self_attn.qkv_proj)
            h = self.self_attn.attend(qkv, positions, cos_sin, kv_cache, meta, backend)
        if self.sandwich:  # Gemma: the attention's output is normed before its residual add
            h, _ = self.post_attention_layernorm(h)
        norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        if self.moe:  # routed per token: the norm feeds the router and the experts
            h, residual = norm(h, residual)
            out = self.mlp(h)
        else:
            gate_up, residual = self.norm_into(norm, h, residual, self.mlp.gate_up_proj)
            out = self.mlp.down(gate_up)
        if self.sandwich:
            out, _ = self.post_feedforward_layernorm(out)
        return out, residual

    @staticmethod
    def norm_into(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                  proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """proj(norm(x, residual)) and the new residual."""
        if norm.unit_offset:  # no one-row fused norm + product for Gemma's norm: two steps
            h, new_residual = norm(x, residual)
            return proj(h), new_residual
        return norm.ops.norm_linear(x, residual, norm.weight, norm.eps, proj)


def mrope_axes(cfg: TextModelConfig) -> torch.Tensor:
    """[1, 1, rotary_dims] int64: the M-RoPE axis (0 t, 1 h, 2 w) of each cos/sin column; the cos and sin
    halves repeat the sections (HF's mrope_section over cat(freqs, freqs)). Zeros for 1D rotary.
    Interleaved (Qwen3-VL's apply_interleaved_mrope): column i takes h when i % 3 == 1 and i < 3 * h's
    section, w when i % 3 == 2 and i < 3 * w's section, else t."""
    half = cfg.rotary_dims // 2
    if cfg.mrope_interleaved and cfg.mrope_section:
        sections = cfg.mrope_section
        axes = [i % 3 if i % 3 and i < 3 * sections[i % 3] else 0 for i in range(half)]
    else:
        axes = [a for a, n in enumerate(cfg.mrope_section) for _ in range(n)] or [0] * half
    return torch.tensor(axes + axes, dtype=torch.int64).view(1, 1, -1)


def check_kernels(cfg: TextModelConfig, backend: AttentionBackend, ops: type[TorchOps]) -> None:
    """Refuse kernels that would compute a config's model wrongly: sliding-window layers need a backend
    that masks the window; Gemma's norms and GELU need an ops class that has them."""
    if cfg.has_sliding_layers and not backend.supports_sliding_window:
        raise ValueError(f"{cfg.model_type}: its sliding-window layers need an attention backend that masks "
                         f"the window; {type(backend).__name__} does not")
    if cfg.needs_offset_norm_ops and not hasattr(ops, "offset_rms_norm"):
        raise ValueError(f"{cfg.model_type}: its (1 + w) norms and GELU are not in {ops.__name__} "
                         f"(--attention-backend torch has them)")


class LlamaForCausalLM(nn.Module):
    """The language model. forward takes all scheduled tokens of a batch as one flat sequence.

    With `tp` (decoder_svc/model/parallel.py) `cfg` is this rank's local config (its heads and MLP
    columns), the output head holds this rank's vocabulary slice, and the logits are gathered."""

    def __init__(self, cfg: TextModelConfig, backend: AttentionBackend,
                 ops: type[TorchOps] = TorchOps, tp: TensorParallel | None = None) -> None:
        super().__init__()
        check_kernels(cfg, backend, ops)
        self.config = cfg
        self.backend = backend
        self.ops = ops
        self.tp = tp if tp is not None and tp.size > 1 else None
        reduce = self.tp is not None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, reduce, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size, ops)
        head_rows = self.tp.vocab_rows(cfg.vocab_size) if self.tp else cfg.vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, head_rows, bias=False)
        self.register_buffer("cos_sin", self.rotary_table(cfg), persistent=False)
        # The sliding layers' own rope (Gemma 3: another base, no scaling); the global table when none.
        self.register_buffer("cos_sin_local", self.local_rotary_table(cfg), persistent=False)
        # M-RoPE: which of the three position rows (t, h, w) each column of a cos/sin row reads.
        self.register_buffer("mrope_axis", mrope_axes(cfg), persistent=False)
        # Each layer's KV cache group (model/kv_groups.py): which of a step's metadata it reads.
        self.kv_groups = layer_groups(cfg)
        self.layer_group = group_of_layer(self.kv_groups, cfg.num_layers)
        # LoRA adapters (model/lora/): each token row's adapter slot, bound per forward; None without any.
        self.lora: LoRASlots | None = None
        # The deterministic mode (model/batch_invariant.py): forward runs inside BatchInvariantMatmuls.
        self.batch_invariant = False

    def graphs_run_linear_steps(self, device: torch.device) -> bool:
        """Whether CUDA graphs may capture this stack's small steps beyond plain decode: true for a stack
        without linear layers; for a hybrid one, when every linear layer takes a graph's rows on `device`
        (model/linear_state.py's LinearGraphRows) and the deterministic mode is off."""
        linear = [layer.linear_attn for layer in self.layers if layer.linear]
        return not linear or (not self.batch_invariant and all(m.runs_graph_rows(device) for m in linear))

    @property
    def uses_mrope(self) -> bool:
        """True when positions are [3, tokens] (Qwen2.5-VL) rather than [tokens]."""
        return bool(self.config.mrope_section)

    def rotary_table(self, cfg: TextModelConfig) -> torch.Tensor:
        """fp32 [max_model_len, rotary_dims]: cos then sin of every position's angles (indexed, no host
        work). Only the served positions: beyond max_model_len a longrope table would not be HF's."""
        return cos_sin_table(cfg, self.ops.make_cos_sin_cache)

    def local_rotary_table(self, cfg: TextModelConfig) -> torch.Tensor:
        """The sliding layers' table (rotary_table of cfg.local_rope()); an empty one when no layer slides."""
        if not cfg.has_sliding_layers:
            return torch.empty(0, cfg.rotary_dims)
        return self.rotary_table(cfg.local_rope())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [tokens, hidden] (times embed_scale, a tensor in their dtype, as HF's Gemma)."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora_slots: torch.Tensor | None = None,
        linear_state: LinearStateStep | None = None,
        merged_adapter: bool = False,
    ) -> torch.Tensor:
        """Run every layer over the flat batch; return fp32 logits only for rows logits_indices.
        positions: [tokens], or [3, tokens] for M-RoPE (one row is enough where the three are equal).
        meta: one for every layer, or one per KV cache group (their block tables and slots; layer i
        reads meta[self.layer_group[i]]); kv_caches: each layer's tensor (its group's pool).
        deepstack (Qwen3-VL): (image rows [n], levels [L, n, hidden]); level i is added to the hidden
        states of those rows after layer i, as HF's _deepstack_process does. Image rows None: levels
        [L, tokens, hidden] over every row, zeros off the image rows (a CUDA graph's static buffer).
        lora_slots: each token row's adapter slot [tokens] (model/lora/batched.py); None: the base model.
        linear_state: a hybrid stack's state slots and which rows continue which (model/linear_state.py);
        the linear layers read and update them. None for a stack without linear layers.
        merged_adapter: every row runs the adapter merged at load, on its merged weights (no lora_slots;
        model/lora/merged.py)."""
        if self.batch_invariant and not invariant_matmuls_active():
            with BatchInvariantMatmuls():
                return self.forward(positions, meta, kv_caches, logits_indices, input_ids, inputs_embeds,
                                    deepstack, lora_slots, linear_state, merged_adapter)
        x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        if self.lora is not None:
            self.lora.bind(lora_slots, x.shape[0], merged_adapter)
        cos_sin = self.cos_sin
        if positions.dim() == 2:  # M-RoPE [3, tokens]
            # Each token's cos/sin row, its columns taken from the rows of its t, h or w position; the
            # rotary kernels then read row i for token i.
            cos_sin = self.cos_sin[positions].gather(0, self.mrope_axis.expand(1, positions.shape[1], -1))[0]
            positions = torch.arange(positions.shape[1], device=positions.device)
        residual = None
        levels = deepstack[1].shape[0] if deepstack is not None else 0
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            table = self.cos_sin_local if layer.sliding else cos_sin
            layer_meta = meta[self.layer_group[i]] if isinstance(meta, list) else meta
            x, residual = layer(x, residual, positions, table, kv_cache, layer_meta, self.backend,
                                linear_state)
            if i < levels:
                # HF adds the level to the layer's output (residual + mlp out), so the sum that our norms
                # defer is made here; the next layer then starts from it with no residual.
                slots, rows = deepstack
                x = x + residual
                if slots is None:  # every row (x + 0 is x: the other rows keep their values exactly)
                    x = x + rows[i]
                else:
                    x[slots] = x[slots] + rows[i]
                residual = None
        # Norm and lm_head only on the rows we sample from: the rest are partial prefill chunks.
        rows = None if residual is None else residual[logits_indices]
        logits, _ = DecoderLayer.norm_into(self.norm, x[logits_indices], rows, self.lm_head)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model's dtype, as HF
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        return gather_vocab(logits, self.config.vocab_size) if self.tp else logits
