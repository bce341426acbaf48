"""Elementwise decoder ops (RMS norm, SwiGLU activation, RoPE) in plain torch: the reference.

`TorchOps` reproduces Hugging Face Llama numerics op for op (same casts, same rounding points), so it is
both the CPU implementation and the oracle that `decoder_svc.model.kernel_dispatch.TritonOps` is tested
against. Both classes expose the same static methods; callers pick one and call through it.

Shapes: tokens are flat rows, T >= 0. `x` [T, H]; `q` [T, Hq, D], `k` [T, Hk, D]; `positions` [T].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from decoder_svc.model.quant.fp8 import ScaleBlock, dequantize

if TYPE_CHECKING:
    from decoder_svc.model.lora.batched import LoRASlots


class TorchOps:
    """Reference ops in plain torch, matching HF LlamaRMSNorm / silu*up / apply_rotary_pos_emb exactly."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMS-normalise x (optionally after adding residual); returns (out, new_residual).

        new_residual is x itself when residual is None, else x + residual in x.dtype (HF's
        `residual + hidden_states`). out = weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype)
        with h = new_residual: normalised in fp32, cast back, then multiplied by weight in the dtype.
        Inputs are not modified.
        """
        h = x if residual is None else x + residual
        dtype = h.dtype
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hf.to(dtype), h

    @staticmethod
    def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm as Gemma's (HF Gemma3RMSNorm): scaled by (1 + weight), the product in fp32 and only then
        cast back (Llama casts before its product). Same residual contract as rms_norm."""
        h = x if residual is None else x + residual
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return (hf * (1.0 + weight.float())).to(h.dtype), h

    @staticmethod
    def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm (offset_rms_norm with `unit_offset`) over each head of q [T, Hq, D] and k [T, Hk, D]
        (strided views of the qkv product) with their own weights: new tensors of their shapes."""
        norm = TorchOps.offset_rms_norm if unit_offset else TorchOps.rms_norm
        return tuple(norm(x.reshape(-1, x.shape[-1]), w, eps)[0].view(x.shape)
                     for x, w in ((q, q_weight), (k, k_weight)))

    @staticmethod
    def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x [T, 2*I] = cat(gate, up) -> gelu_pytorch_tanh(gate) * up [T, I] in x.dtype (Gemma's MLP)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate.contiguous(), approximate="tanh") * up

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x [T, 2*I] = cat(gate, up) -> silu(gate) * up [T, I], both ops in x.dtype as HF does."""
        gate, up = x.chunk(2, dim=-1)
        # contiguous(): CPU silu takes a vector or a scalar path per element depending on layout, which
        # differ by an ulp; HF's gate is a contiguous [T, I] gemm output, so match its layout exactly.
        return F.silu(gate.contiguous()) * up

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE on q [T, Hq, D] and k [T, Hk, D]; returns new (q_rot, k_rot).

        cos_sin_cache [max_pos, R] fp32 holds cat(cos, sin) of the R/2 frequencies per position. As in
        HF, cos and sin are cast to the model dtype first and x*cos + rotate_half(x)*sin runs in that
        dtype (each op rounded). q and k may be strided views; they are not modified.
        Partial rotary (R < D, Phi-4-mini): only the first R dims of each head are rotated (rotate_half
        within them) and the other D - R pass through, as HF's apply_rotary_pos_emb.
        """
        width = cos_sin_cache.shape[-1]
        half = width // 2
        cs = cos_sin_cache[positions]
        cos, sin = cs[:, :half], cs[:, half:]
        # [T, 1, D]: broadcast over heads; cast before use, like HF's LlamaRotaryEmbedding output.
        cos = torch.cat((cos, cos), dim=-1).to(q.dtype)[:, None, :]
        sin = torch.cat((sin, sin), dim=-1).to(q.dtype)[:, None, :]

        def rot(x: torch.Tensor) -> torch.Tensor:
            part = x[..., :width]
            rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
            out = part * cos + rotated * sin
            return out if width == x.shape[-1] else torch.cat((out, x[..., width:]), dim=-1)

        return rot(q), rot(k)

    @classmethod
    def norm_linear(cls, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(proj(rms_norm(x (+ residual)) * weight), new residual): a norm and the product it feeds."""
        h, new_residual = cls.rms_norm(x, weight, eps, residual)
        return proj(h), new_residual

    @classmethod
    def act_linear(cls, x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """proj(silu(gate) * up) for x = cat(gate, up): the MLP's activation and down projection."""
        return proj(cls.silu_and_mul(x))

    @staticmethod
    def linear(x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """proj(x), through the ops so that a one-row product can take a faster kernel."""
        return proj(x)

    @staticmethod
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: ScaleBlock,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] @ (weight * scale)^T + bias with an FP8 weight [N, K] (quant.fp8's layout): the weight
        dequantized in fp32, rounded once to x's dtype, then an ordinary product in that dtype."""
        return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)

    @staticmethod
    def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 rows: LoRASlots, rank: int) -> torch.Tensor:
        """y plus each row's LoRA product over its adapter slot (model/lora/batched.py's layout; rows: the
        forward's LoRASlots)."""
        from decoder_svc.model.lora.reference import lora_add_reference

        return lora_add_reference(y, x, lora_a, lora_b, rows.slots, rank)

    @staticmethod
    def make_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
        """fp32 [max_positions, D]: row p = cat(cos(p * inv_freq), sin(p * inv_freq)), angles as HF."""
        positions = torch.arange(max_positions, device=inv_freq.device)
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
